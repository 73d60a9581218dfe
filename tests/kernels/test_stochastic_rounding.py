"""Stochastic rounding (qtrain/kernels/stochastic_rounding.py): exactness, unbiasedness, special values,
determinism and sharding, e4m3 encoding, and twin == Triton (interpreter on CPU, compiled on GPU).

``test_interpreter_subprocess`` re-runs this file's ``test_interp_*`` tests with TRITON_INTERPRET=1.
"""

import subprocess
import sys

import pytest
import torch

from tests.triton_interp import ROOT, interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch
from qtrain.kernels.rng import KeySlot, KeyTable, random_u32_of_twin, random_u32_twin, rng_key
from qtrain.kernels.stochastic_rounding import (
    e4m3_bits_to_f32_twin,
    round_to_bf16_sr,
    sr_add_,
    sr_add_twin,
    sr_copy_,
    sr_copy_twin,
    sr_e4m3_bits_twin,
    sr_sum_,
    sr_sum_twin,
)



test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def f32_from_bits(bits) -> torch.Tensor:
    b = torch.as_tensor(bits, dtype=torch.int64)
    return (b - ((b >> 31) << 32)).to(torch.int32).view(torch.float32)


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def binomial_ok(k: int, n: int, p: float) -> bool:
    """|k - np| within 5 sigma of Binomial(n, p) (+1 count of slack for p near 0 or 1)."""
    return abs(k - n * p) <= 5 * (n * p * (1 - p)) ** 0.5 + 1


# --------------------------------------------------------------------------------- fp32 -> bf16 basics
def test_exact_on_bf16_values():
    b = torch.randint(0, 0x10000, (50000,))
    b = b[((b & 0x7FFF) <= 0x7F80)]  # finite bf16 and +-inf, every exponent incl. subnormals and +-0
    x = f32_from_bits(b << 16)
    for key in range(5):
        assert torch.equal(bf16_bits(round_to_bf16_sr(x, key=key)), b)


@pytest.mark.parametrize("lo_bits", [0x3F80, 0x3FFF, 0xC060, 0x0003, 0x0000, 0x8001, 0x7F7E])
@pytest.mark.parametrize("r", [1, 6554, 32768, 58982, 65535])
def test_unbiased_between_neighbours(lo_bits, r):
    """x = lo + r/2**16 ulp: SR gives lo or the next bf16 away from zero, the latter with probability r/2**16.

    lo_bits: 1.0; 1.9921875 (next is 2.0, a binade edge); -3.5; subnormal 3*2**-133; 0 (next is the
    smallest subnormal); -2**-133; bf16 max's lower neighbour.
    """
    x = f32_from_bits((lo_bits << 16) + r)
    n_keys, n_elem = 64, 1024
    ups = 0
    for k in range(n_keys):
        y = bf16_bits(round_to_bf16_sr(x.expand(n_elem).contiguous(), key=rng_key(11, k)))
        assert bool(((y == lo_bits) | (y == lo_bits + 1)).all())
        ups += int((y == lo_bits + 1).sum())
    assert binomial_ok(ups, n_keys * n_elem, r / 65536), (ups, n_keys * n_elem * r / 65536)


def test_each_result_is_one_of_the_two_neighbours_at_every_exponent():
    torch.manual_seed(0)
    b = torch.randint(0, 0x7F7F0000, (200000,)) | (torch.randint(0, 2, (200000,)) << 31)
    x = f32_from_bits(b)
    y = bf16_bits(round_to_bf16_sr(x, key=5))
    trunc = b >> 16
    assert bool(((y == trunc) | (y == trunc + 1)).all())


def test_special_values_and_no_overflow_beyond_round_to_nearest():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([inf, -inf, nan, -nan, 0.0, -0.0])
    y = bf16_bits(round_to_bf16_sr(x, key=1))
    assert y.tolist() == [0x7F80, 0xFF80, 0x7FC0, 0x7FC0, 0x0000, 0x8000]
    # top slot |x| in [bf16 max, fp32 max]: round to nearest (never inf unless RN is inf)
    top = torch.randint(0x7F7F0000, 0x7F800000, (20000,))
    top = torch.cat([top, top | (1 << 31), torch.tensor([0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF])])
    xt = f32_from_bits(top)
    for key in range(3):
        assert torch.equal(round_to_bf16_sr(xt, key=key).view(torch.int16), xt.to(torch.bfloat16).view(torch.int16))
    # anything finite whose RN is finite never becomes inf
    below = f32_from_bits(torch.randint(0x7F000000, 0x7F7F8000, (20000,)))
    assert torch.isfinite(round_to_bf16_sr(below, key=9).float()).all()


# --------------------------------------------------------------------------------- determinism, shards
def test_deterministic_per_key_and_offset_gives_sharded_equality():
    torch.manual_seed(1)
    x = torch.randn(3001)
    a, b = round_to_bf16_sr(x, key=77), round_to_bf16_sr(x, key=77)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    c = round_to_bf16_sr(x, key=78)
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))
    cuts = [0, 1, 1000, 2048, 3001]
    parts = [round_to_bf16_sr(x[s:e], key=77, offset=s) for s, e in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(parts).view(torch.int16), a.view(torch.int16))
    # sr_add_ of a slice with offset = slice start matches the unsharded add
    d0 = torch.randn(3001).bfloat16()
    full = sr_add_(d0.clone(), x, key=5, scale=0.25)
    sharded = d0.clone()
    for s, e in zip(cuts, cuts[1:]):
        sr_add_(sharded[s:e], x[s:e], key=5, scale=0.25, offset=s)
    assert torch.equal(full.view(torch.int16), sharded.view(torch.int16))


# ------------------------------------------------------------------------------------- sr_add_/copy_
def test_fp32_destination_is_plain_fp32_arithmetic():
    torch.manual_seed(2)
    d, s = torch.randn(777), torch.randn(777)
    for src in (s, s.bfloat16(), s.half()):
        out = sr_add_(d.clone(), src, key=3, scale=0.3)
        assert torch.equal(out, d + src.float() * 0.3)  # fp32(0.3) * src, then + d: two roundings, no FMA
        assert torch.equal(sr_copy_(torch.empty(777), src, key=3, scale=2.0), src.float() * 2.0)


def test_bf16_destination_is_sr_of_the_fp32_result():
    torch.manual_seed(3)
    d, s = torch.randn(4099).bfloat16(), torch.randn(4099)
    out = sr_add_(d.clone(), s, key=8, scale=0.7, offset=12)
    want = round_to_bf16_sr(d.float() + s * 0.7, key=8, offset=12)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    out = sr_copy_(torch.empty(4099, dtype=torch.bfloat16), s.half(), key=8, scale=0.7)
    assert torch.equal(out.view(torch.int16), round_to_bf16_sr(s.half().float() * 0.7, key=8).view(torch.int16))


def test_sr_accumulation_does_not_stall():
    """Adding 1e-4 to 1.0 in bf16 (half ulp 2**-8 = 0.0039): round-to-nearest never moves, SR tracks fp32.

    Per element the final error has variance <= steps * ulp**2 / 4 (sd ~0.068 for 300 steps); the mean
    over 4096 elements has sd <= 0.0011, so 0.006 is > 5 sigma.
    """
    n, steps, inc = 4096, 300, torch.full((4096,), 1e-4)
    sr = torch.ones(n, dtype=torch.bfloat16)
    rn = torch.ones(n, dtype=torch.bfloat16)
    exact = torch.ones(n)
    for t in range(steps):
        sr_add_(sr, inc, key=rng_key(123, t))
        rn = (rn.float() + inc).bfloat16()
        exact += inc
    assert torch.equal(rn, torch.ones(n, dtype=torch.bfloat16))
    assert abs(sr.float().mean().item() - exact.mean().item()) < 0.006


def test_argument_errors_name_the_problem():
    with pytest.raises(TypeError, match="unsupported dtypes.*float16"):
        sr_add_(torch.zeros(4, dtype=torch.float16), torch.zeros(4), key=0)
    with pytest.raises(TypeError, match="unsupported dtypes.*int32"):
        sr_copy_(torch.zeros(4), torch.zeros(4, dtype=torch.int32), key=0)
    with pytest.raises(ValueError, match="elements"):
        sr_add_(torch.zeros(4), torch.zeros(5), key=0)
    with pytest.raises(ValueError, match="contiguous"):
        sr_add_(torch.zeros(4, 4)[:, 0], torch.zeros(4), key=0)
    with pytest.raises(TypeError, match="fp32"):
        round_to_bf16_sr(torch.zeros(4, dtype=torch.bfloat16), key=0)
    assert round_to_bf16_sr(torch.zeros(2, 3), key=0).shape == (2, 3)
    assert round_to_bf16_sr(torch.zeros(0), key=0).numel() == 0


# ------------------------------------------------------------------------------------------- e4m3
def test_e4m3_decode_matches_torch_on_all_codes():
    codes = torch.arange(256)
    ours = e4m3_bits_to_f32_twin(codes)
    ref = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(ours.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert torch.equal(ours[ok].view(torch.int32), ref[ok].view(torch.int32))


def test_e4m3_exact_saturating_and_nan():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F])
    x = e4m3_bits_to_f32_twin(codes)
    for k in range(3):
        assert torch.equal(sr_e4m3_bits_twin(x, random_u32_twin(k, torch.arange(len(x)))), codes)
    x = torch.tensor([448.0, 460.0, 1e6, float("inf"), -500.0, -float("inf"), float("nan")])
    rand = torch.full((7,), 0xFFFFF)  # always round away from zero
    assert sr_e4m3_bits_twin(x, rand).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]


@pytest.mark.parametrize(
    "lo_code,frac", [(0x38, 0.3), (0x01, 0.5), (0x00, 0.25), (0x07, 0.7), (0x7D, 0.9), (0xB9, 0.6), (0x80, 0.1)]
)
def test_e4m3_unbiased_between_neighbours(lo_code, frac):
    """Codes: 1.0 -> 1.125; subnormal 2**-9 -> 2*2**-9; 0 -> 2**-9; largest subnormal -> min normal;
    416 -> 448; -1.125 -> -1.25; -0 -> -2**-9."""
    lo = e4m3_bits_to_f32_twin(torch.tensor([lo_code])).item()
    hi = e4m3_bits_to_f32_twin(torch.tensor([lo_code + 1])).item()
    n = 1 << 16
    x = torch.full((n,), lo + frac * (hi - lo))
    codes = sr_e4m3_bits_twin(x, random_u32_twin(rng_key(4, lo_code), torch.arange(n)))
    assert bool(((codes == lo_code) | (codes == lo_code + 1)).all())
    p = (x[0].item() - lo) / (hi - lo)  # the exact fraction after x was rounded to fp32
    assert binomial_ok(int((codes == lo_code + 1).sum()), n, p)


# --------------------------------------------------------------------------------- Triton == twin
def _sr_cases(device):
    """(dst dtype, src dtype, add, scale, offset, n) covering every kernel variant and odd tails."""
    for dst in (torch.bfloat16, torch.float32):
        for src in (torch.float32, torch.bfloat16, torch.float16):
            for add in (True, False):
                yield dst, src, add, 0.3 if add else 1.0, 2**32 - 100, 4097
    yield torch.bfloat16, torch.float32, True, 1.0, 0, 1
    yield torch.bfloat16, torch.bfloat16, True, 1.0, 2**32 + 7, 5000  # high word 1, absorbed on the host
    yield torch.bfloat16, torch.float32, False, 1.0, 7, 12289


def _check_triton_vs_twin(device, seed):
    torch.manual_seed(seed)
    for dst_dt, src_dt, add, scale, offset, n in _sr_cases(device):
        src = (torch.randn(n, device=device) * 4).to(src_dt)
        if src_dt == torch.float32 and n > 16:
            src[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.3e38, -3.39e38, 1e-40])
        dst = torch.randn(n, device=device).to(dst_dt)
        fn, twin = (sr_add_, sr_add_twin) if add else (sr_copy_, sr_copy_twin)
        with dispatch.backend("triton"):
            a = fn(dst.clone(), src, key=rng_key(seed), scale=scale, offset=offset)
        b = twin(dst.clone(), src, key=rng_key(seed), scale=scale, offset=offset)
        view = torch.int16 if dst_dt == torch.bfloat16 else torch.int32
        assert torch.equal(a.view(view), b.view(view)), (dst_dt, src_dt, add)


def _check_specials_triton_vs_twin(device, seed):
    """The kernel's bf16 rounding on the edge patterns (the top slot, where it rounds to nearest, its neighbours,
    inf, NaNs, zeros, subnormals), both signs, against the twin (and so against torch's RN in the top slot)."""
    gen = torch.Generator().manual_seed(seed)
    edge = torch.tensor([0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7FFFFF, 0x7F7EFFFF, 0x7F7E8000,
                         0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0, 1, 0x8000, 0x7FFF, 0x00FF8000])
    bits_ = torch.cat([edge, torch.randint(0x7F7F0000, 0x7F800000, (3000,), generator=gen),
                       torch.randint(0, 0x7F800000, (3000,), generator=gen)])
    src = f32_from_bits(torch.cat([bits_, bits_ | (1 << 31)])).to(device)
    dst = torch.empty(src.numel(), dtype=torch.bfloat16, device=device)
    with dispatch.backend("triton"):
        a = sr_copy_(dst.clone(), src, key=rng_key(seed, 5), offset=3)
    b = sr_copy_twin(dst.clone(), src, key=rng_key(seed, 5), offset=3)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def _check_sum_triton_vs_twin(device, seed):
    """sr_sum_ over column slices of a (W, shard) buffer, as the all-to-all manager calls it."""
    torch.manual_seed(seed)
    for world, dst_dt, src_dt, add, scale in ((1, torch.bfloat16, torch.bfloat16, False, 1.0),
                                              (2, torch.bfloat16, torch.bfloat16, True, 0.5),
                                              (4, torch.bfloat16, torch.bfloat16, False, 0.25),
                                              (3, torch.float32, torch.float32, True, 1 / 3)):
        recv = (torch.randn(world, 9000, device=device) * 3).to(src_dt)
        parts = recv[:, 123:123 + 4097]
        dst = torch.randn(4097, device=device).to(dst_dt)
        with dispatch.backend("triton"):
            a = sr_sum_(dst.clone(), parts, key=rng_key(seed, world), scale=scale, offset=2**32 - 5, add=add)
        b = sr_sum_twin(dst.clone(), parts, key=rng_key(seed, world), scale=scale, offset=2**32 - 5, add=add)
        view = torch.int16 if dst_dt == torch.bfloat16 else torch.int32
        assert torch.equal(a.view(view), b.view(view)), (world, dst_dt, add)


def test_sr_sum_is_the_fixed_order_fp32_sum_then_sr():
    """The twin's definition against its parts: (dst +) p0 + p1 + ... in fp32, one rounding per add, then
    sr_copy_'s scale and SR; and W = 1 without add is plain sr_copy_."""
    g = torch.Generator().manual_seed(3)
    parts = (torch.randn(3, 500, generator=g) * 5).to(torch.bfloat16)
    dst = torch.randn(500, generator=g).to(torch.bfloat16)
    acc = dst.float() + parts[0].float()
    acc = (acc + parts[1].float()) + parts[2].float()
    want = sr_copy_twin(dst.clone(), acc, key=9, scale=0.25, offset=40)
    got = sr_sum_(dst.clone(), parts, key=9, scale=0.25, offset=40, add=True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    one = sr_sum_(dst.clone(), parts[:1], key=9, scale=0.5)
    assert torch.equal(one.view(torch.int16), sr_copy_twin(dst.clone(), parts[0], key=9, scale=0.5).view(torch.int16))
    with pytest.raises(ValueError, match="contiguous rows"):
        sr_sum_(dst[:250].clone(), parts[:, ::2], key=1)


def _table_for(cases, seed: int, device) -> KeyTable:
    """A key table with one slot per case (ids = the case's position), filled for prefix (seed,)."""
    table = KeyTable([((i,), offset, n) for i, (offset, n) in enumerate(cases)], device=device)
    table.fill(seed, 4, 2)  # e.g. step 4, micro-step 2
    return table


def _check_key_table_vs_scalar(device, seed, *, triton: bool):
    """A launch whose key is a KeySlot gives the bits of the scalar launch with the key the table was filled
    for, for sr_add_, sr_copy_ and sr_sum_, at counter offsets whose high word is absorbed or not; the
    reference is always the scalar twin (the specification)."""
    torch.manual_seed(seed)
    cases = [c[4:] for c in _sr_cases(device)] + [(2**32 - 5, 4097)]
    table = _table_for(cases, seed, device)
    backend = "triton" if triton else "twin"
    for i, (dst_dt, src_dt, add, scale, offset, n) in enumerate(_sr_cases(device)):
        key = rng_key(seed, 4, 2, i)
        src = (torch.randn(n, device=device) * 4).to(src_dt)
        dst = torch.randn(n, device=device).to(dst_dt)
        fn, twin = (sr_add_, sr_add_twin) if add else (sr_copy_, sr_copy_twin)
        with dispatch.backend(backend):
            a = fn(dst.clone(), src, key=table.slot((i,), offset, n), scale=scale, offset=offset)
        b = twin(dst.clone(), src, key=key, scale=scale, offset=offset)
        view = torch.int16 if dst_dt == torch.bfloat16 else torch.int32
        assert torch.equal(a.view(view), b.view(view)), (i, dst_dt, src_dt, add)
    i = len(cases) - 1
    parts = (torch.randn(3, 9000, device=device) * 3).to(torch.bfloat16)[:, 123:123 + 4097]
    dst = torch.randn(4097, device=device).to(torch.bfloat16)
    with dispatch.backend(backend):
        a = sr_sum_(dst.clone(), parts, key=table.slot((i,), 2**32 - 5, 4097), scale=0.5, offset=2**32 - 5, add=True)
    b = sr_sum_twin(dst.clone(), parts, key=rng_key(seed, 4, 2, i), scale=0.5, offset=2**32 - 5, add=True)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_key_table_twin_matches_scalar_twin():
    _check_key_table_vs_scalar("cpu", seed=5, triton=False)


def test_key_table_refill_changes_the_bits_and_matches_the_new_key():
    """The same slot after a refill for another (step, micro-step) draws that key's bits: what a graph
    replayed at another micro-step needs."""
    x = torch.randn(3000) * 3
    table = KeyTable([((0, 1), 0, 3000)], device="cpu")
    slot = table.slot((0, 1), 0, 3000)
    outs = []
    for step, micro in ((0, 0), (0, 1), (7, 0)):
        table.fill(11, step, micro)
        got = sr_copy_(torch.empty(3000, dtype=torch.bfloat16), x, key=slot)
        want = sr_copy_twin(torch.empty(3000, dtype=torch.bfloat16), x, key=rng_key(11, step, micro, 0, 1))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        outs.append(got.view(torch.int16))
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    idx = torch.arange(2**32 - 3, 2**32 + 3)  # straddles a high word: the kernel hashes both words
    table = KeyTable([((), 2**32 - 3, 6)], device="cpu")
    table.fill(3)
    assert torch.equal(random_u32_of_twin(table.slot((), 2**32 - 3, 6), idx, 2**32 - 3, 6),
                       random_u32_twin(rng_key(3), idx))


def test_key_table_lists_every_launch_up_front():
    table = KeyTable([((1, 2), 0, 10)], device="cpu")
    assert table.slot((1, 2), 0, 10) == KeySlot(table.table, 0)
    with pytest.raises(KeyError, match="no slot for launch ids=\\(1, 3\\)"):
        table.slot((1, 3), 0, 10)
    with pytest.raises(ValueError, match="listed twice"):
        KeyTable([((1,), 0, 5), ((1,), 0, 5)], device="cpu")


@interp_only
def test_interp_triton_matches_twin():
    _check_triton_vs_twin("cpu", seed=0)
    _check_specials_triton_vs_twin("cpu", seed=0)
    _check_sum_triton_vs_twin("cpu", seed=0)


@interp_only
def test_interp_key_table_matches_scalar_twin():
    _check_key_table_vs_scalar("cpu", seed=0, triton=True)


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_matches_twin():
    _check_triton_vs_twin("cuda", seed=1)
    _check_specials_triton_vs_twin("cuda", seed=1)
    _check_sum_triton_vs_twin("cuda", seed=1)
    _check_key_table_vs_scalar("cuda", seed=1, triton=True)
    x = torch.randn(3 * 2**20 + 5, device="cuda")
    a = round_to_bf16_sr(x, key=3, offset=11)  # dispatch: Triton
    b = sr_copy_twin(torch.empty_like(x, dtype=torch.bfloat16), x, key=3, offset=11)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.equal(a.view(torch.int16).cpu(), round_to_bf16_sr(x.cpu(), key=3, offset=11).view(torch.int16))


def test_twins_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from qtrain.kernels import dispatch, round_to_bf16_sr\n"
        "from qtrain.numerics import AdamWHyper, adamw_update_\n"
        "assert not dispatch.HAS_TRITON\n"
        "y = round_to_bf16_sr(torch.randn(10), key=1)\n"
        "p, g, m, v = torch.randn(10), torch.randn(10), torch.zeros(10), torch.zeros(10)\n"
        "adamw_update_(p, g, m, v, hp=AdamWHyper(lr=1e-3, step=1), decay=True, key=1)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
