"""The `hopper-gemm` kind (bench/bench_hopper_gemm.py) on the CPU, where quack-kernels is not installed: it imports,
its suite's dry run checks the shapes and skips with the reason; and its pairing of qtrain's ops with quack's -- the
weight re-layouts, the interleaved gate/up columns, which output is compared with which -- agrees on every op when
quack's calls are stood in for by the semantics of quack 0.6.5's own reference functions (`gemm_act_ref`,
`gemm_dgated_ref`, `gemm_rms_ref`, `gemm_norm_act_ref`, `rmsnorm_ref` in quack/gemm_interface.py and rmsnorm.py), so a
layout mistake shows here and not after a device call. And bench/hopper_wheels.sh's split and join give back the
same wheels (slow; skipped where the wheels are not downloaded, as in CI)."""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from bench import bench_hopper_gemm as hg
from bench.kinds import Skip
from bench.suite import REPO_ROOT, load

SUITE_SHAPES = {"Qwen2.5-0.5B": (32768, 896, 4864), "Qwen2.5-1.5B": (32768, 1536, 8960),
                "Qwen2.5-3B": (16384, 2048, 11008), "Qwen2.5-7B": (4096, 3584, 18944)}


def test_imports_without_quack_and_the_suite_dry_run_checks_shapes_then_skips():
    lib, why = hg.import_quack()
    if lib is None:
        assert why  # the reason the kind's run and dry run give
    seen = {}
    for run in load("hopper").runs:
        assert run.kind == "hopper-gemm"
        for s in hg.shapes(run.params["models"], run.params.get("tokens"), run.params.get("ops", hg.OPS)):
            seen[s.model] = (s.M, s.C, s.F)
        with pytest.raises(Skip, match="Hopper GPU"):
            hg.dry_run(run.params)
    assert seen == SUITE_SHAPES
    with pytest.raises(ValueError, match="ops: unknown"):
        hg.dry_run({"models": ["Qwen2.5-0.5B"], "ops": ["swiglu"]})
    with pytest.raises(ValueError, match="no default token count"):
        hg.dry_run({"models": ["Qwen3-0.6B"]})


# ---- quack's calls as its reference functions define them (bf16 in, fp32 math, bf16 out) ----
def _gated(pre: torch.Tensor) -> torch.Tensor:
    """quack's gated activations read gate = even columns, up = odd columns (gemm_act_ref)."""
    return F.silu(pre[..., ::2]) * pre[..., 1::2]


def _concat_b(b: torch.Tensor) -> torch.Tensor:
    """concat_layout=("B",): B's non-contiguous dim holds [gate; up], read as interleaved (_concat_interleave)."""
    dim = -2 if b.stride(-1) == 1 else -1
    return b.unflatten(dim, (2, b.shape[dim] // 2)).transpose(dim - 1, dim).flatten(dim - 1, dim)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.float()


def reference_quack(swap_gate_up: bool = False) -> SimpleNamespace:
    bf = torch.bfloat16

    def gemm_act(A, B, activation, store_preact, tuned, concat_layout=None):
        assert activation == "swiglu" and store_preact and A.shape[-1] == B.shape[0]
        pre = A.float() @ (_concat_b(B) if concat_layout == ("B",) else B).float()
        if swap_gate_up:
            pre = torch.stack([pre[..., 1::2], pre[..., ::2]], -1).flatten(-2)
        return pre.to(bf), _gated(pre).to(bf)

    def gemm_add(A, B, C, tuned):
        return (A.float() @ B.float() + C.float()).to(bf)

    def gemm_dgated(A, B, PreAct, activation, tuned):
        dout = (A.float() @ B.float()).to(bf).float()
        with torch.enable_grad():
            gate, up = PreAct[..., ::2].float().requires_grad_(), PreAct[..., 1::2].float().requires_grad_()
            post = F.silu(gate) * up
            dgate, dup = torch.autograd.grad(post, (gate, up), dout)
        return torch.stack([dgate, dup], -1).reshape(PreAct.shape).to(bf), post.detach().to(bf)

    def gemm_rms(A, B, C, norm_weight, premult_out, eps, tuned):
        d = A.float() @ B.float() + C.float()
        premult_out.copy_(d)
        return (d * norm_weight.float()).to(bf), torch.rsqrt(d.square().mean(-1) + eps)

    def gemm_norm_act(A, B, rstd, activation, store_preact, tuned):
        pre = (A.float() @ B.float()) * rstd[:, None]
        return pre.to(bf), _gated(pre).to(bf)

    def rmsnorm_fwd(x, weight, residual=None, eps=1e-6):
        xf = x.float() + (residual.float() if residual is not None else 0)
        return _norm(xf, weight, eps).to(x.dtype), (xf.to(x.dtype) if residual is not None else x), None

    def rmsnorm(x, weight, residual, prenorm, eps):
        xf = x.float() + residual.float()
        return _norm(xf, weight, eps).to(x.dtype), xf.to(x.dtype)

    def cross_entropy_fwd(x, target, return_lse, return_dx, inplace_backward, ignore_index=-100):
        """Per-row loss (0 where ignored), lse, and softmax - onehot over x (zero rows where ignored)."""
        assert return_lse and return_dx and inplace_backward
        xf = x.float()
        lse = torch.logsumexp(xf, -1)
        keep = target != ignore_index
        safe = torch.where(keep, target, 0)
        loss = torch.where(keep, lse - xf.gather(1, safe[:, None])[:, 0], 0.0)
        d = torch.exp(xf - lse[:, None])
        d[torch.arange(len(d)), safe] -= 1.0
        x.copy_(d * keep[:, None])
        return loss, lse, x

    return SimpleNamespace(gemm=SimpleNamespace(gemm_act=gemm_act, gemm_add=gemm_add, gemm_dgated=gemm_dgated,
                                                gemm_rms=gemm_rms, gemm_norm_act=gemm_norm_act),
                           rmsnorm=SimpleNamespace(rmsnorm_fwd=rmsnorm_fwd, rmsnorm=rmsnorm),
                           cross_entropy=SimpleNamespace(cross_entropy_fwd=cross_entropy_fwd))


SMALL = hg.Shape("tiny", M=64, C=32, F=48, Q=32, eps=1e-6, V=1000)


def _rel_errors(lib: SimpleNamespace, ops=hg.OPS) -> dict[str, float]:
    out = {}
    for op, make in hg.pairs_for(SMALL, list(ops), lib, tuned=False, device="cpu", compile_=lambda fn: fn):
        pair = make()
        with torch.no_grad():
            out[op] = hg.errors(pair.compare(pair.quack(), pair.qtrain()))[0]
    return out


def test_every_op_pairs_qtrains_outputs_with_quacks_in_one_layout():
    rel = _rel_errors(reference_quack())
    assert set(rel) == set(hg.OPS)
    assert all(e < hg.TOLERANCE for e in rel.values()), rel
    # the comparison sees a layout mistake: gate and up swapped in the GEMM output
    wrong = _rel_errors(reference_quack(swap_gate_up=True), ops=("up_swiglu",))
    assert wrong["up_swiglu"] > 0.5


def test_the_cross_entropy_pair_compares_loss_lse_and_the_gradient_written_in_place():
    """Both sides overwrite their own copy of the same logits; a stand-in that leaves the ignored rows' gradient
    alone (quack zeroes them, as qtrain does) is seen."""
    lib = reference_quack()
    (_, make), = hg.pairs_for(SMALL, ["cross_entropy"], lib, tuned=False, device="cpu", compile_=lambda fn: fn)
    pair = make()
    k, q = pair.quack(), pair.qtrain()
    assert k[2].data_ptr() != q[2].data_ptr() and k[2].shape == (SMALL.M // hg.CE_ROWS_DIVISOR, SMALL.V)
    assert hg.errors(pair.compare(k, q))[0] < 1e-2
    keep_ignored = reference_quack()
    fwd = keep_ignored.cross_entropy.cross_entropy_fwd

    def sloppy(x, target, **kw):
        before = x.clone()
        loss, lse, d = fwd(x, target, **kw)
        d[target == -100] = before[target == -100]
        return loss, lse, d
    keep_ignored.cross_entropy.cross_entropy_fwd = sloppy
    (_, make), = hg.pairs_for(SMALL, ["cross_entropy"], keep_ignored, tuned=False, device="cpu",
                              compile_=lambda fn: fn)
    pair = make()
    assert hg.errors(pair.compare(pair.quack(), pair.qtrain()))[0] > 0.1


def test_interleave_and_deinterleave_are_inverse_and_match_quacks_concat_layout():
    u = torch.arange(2 * 6.0).reshape(1, 12)  # [up_0..up_5 | gate_0..gate_5]
    il = hg.interleave(u)
    assert il[0, :4].tolist() == [6.0, 0.0, 7.0, 1.0]  # gate_0, up_0, gate_1, up_1
    assert torch.equal(hg.deinterleave(il), u)
    w_up = torch.randn(12, 5)  # rows [up; gate]
    w_gu = torch.cat([w_up[6:], w_up[:6]])
    assert torch.equal(_concat_b(w_gu.T), hg.interleave(w_up.T))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.skipif(not (REPO_ROOT / ".whl" / "quack").is_dir(), reason="the wheels are not downloaded (.whl/quack)")
def test_split_then_install_gives_back_the_same_wheels(tmp_path):
    script = REPO_ROOT / "bench" / "hopper_wheels.sh"
    env = dict(os.environ, WHL_DEST=str(tmp_path / "w"), SITE=str(tmp_path / "site"), CHECK_IMPORT="0",
               TMPDIR=str(tmp_path), PIP_EXTRA="--python-version 3.12 --platform manylinux_2_28_x86_64 "
                                               "--implementation cp --only-binary=:all:")
    subprocess.run(["bash", str(script), "split"], env=env, check=True, timeout=120)
    src = sorted((REPO_ROOT / ".whl" / "quack").glob("*.whl"))
    for folder in ("qa", "qb"):
        assert sum(f.stat().st_size for f in (tmp_path / "w" / folder).iterdir()) < 60 * 2 ** 20
    parts = sorted((tmp_path / "w").glob("q?/*.part-a?"))
    big = [w for w in src if w.stat().st_size > 48 * 2 ** 20]
    assert len(parts) == 2 * len(big) >= 2  # the 88 MiB cu13 wheel went as two parts
    joined = b"".join(p.read_bytes() for p in sorted(parts, key=lambda p: p.name))
    assert hashlib.sha256(joined).hexdigest() == _sha(big[0])
    subprocess.run(["bash", str(script), "install"], env=env, check=True, timeout=300)
    site = tmp_path / "site"
    assert (site / "quack" / "gemm_interface.py").is_file()
    assert (site / "nvidia_cutlass_dsl" / "cu13" / "lib" / "libcute_dsl_runtime.so").is_file()  # the joined wheel
    assert not any((site / p).exists() for p in ("torch", "triton", "nvidia"))
    # a damaged part is refused before pip runs
    part = next((tmp_path / "w" / "qb").glob("*.part-ab"))
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    bad = subprocess.run(["bash", str(script), "install"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "differs from the one split" in bad.stderr
