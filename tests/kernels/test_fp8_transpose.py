"""`transpose_fp8` (qtrain/kernels/fp8_transpose.py): q^T contiguous, the same bits as the twin `q.t().contiguous()`
(bytes are moved, never converted), for shapes that are and are not multiples of the kernel's 64 x 64 tile."""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.fp8_transpose import transpose_fp8, transpose_fp8_torch, transpose_fp8_triton
from tests.triton_interp import interp_only, interpreter_subprocess_test, needs_cuda

E4M3 = torch.float8_e4m3fn
SHAPES = [(64, 64), (48, 32), (130, 70), (1, 200), (257, 3)]
test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def _codes(shape: tuple[int, int], device: str = "cpu") -> torch.Tensor:
    """Every byte value (NaN codes included: their bits must move too)."""
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device).view(E4M3)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.is_contiguous() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_twin_is_the_transpose():
    q = _codes((48, 32))
    qt = transpose_fp8_torch(q)
    assert qt.shape == (32, 48) and qt.is_contiguous()
    assert all(qt[k, n].view(torch.uint8) == q[n, k].view(torch.uint8) for k, n in ((0, 0), (31, 47), (5, 17)))


def test_refuses_what_it_cannot_transpose():
    with pytest.raises(ValueError, match="one-byte"):
        transpose_fp8(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="contiguous"):
        transpose_fp8(_codes((8, 16)).t())


@interp_only
@pytest.mark.parametrize("shape", SHAPES)
def test_interp_kernel_matches_twin(shape):
    q = _codes(shape)
    assert _same(transpose_fp8_triton(q), transpose_fp8_torch(q))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", SHAPES + [(37888, 3584)])
def test_gpu_kernel_matches_twin(shape):
    q = _codes(shape, "cuda")
    assert _same(transpose_fp8(q), transpose_fp8_torch(q))
