"""Fused AdamW (qtrain/numerics/adamw.py over qtrain/kernels/adamw.py): against torch.optim.AdamW, SR
composition, e4m3 m, sharded offsets, the bf16 tiny-lr stall, and twin == Triton bit for bit.

``test_interpreter_subprocess`` re-runs this file's ``test_interp_*`` tests with TRITON_INTERPRET=1.
"""


import pytest
import torch

from tests.triton_interp import interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch
from qtrain.kernels.adamw import adamw_step_twin
from qtrain.kernels.rng import random_u32_twin, rng_key
from qtrain.kernels.stochastic_rounding import (
    bf16_bits_to_f32_twin,
    e4m3_bits_to_f32_twin,
    round_to_bf16_sr,
    sr_bf16_bits_twin,
)
from qtrain.numerics.adamw import M_STREAM, PARAM_STREAM, V_STREAM, AdamWHyper, adamw_update_, m_scales_numel

EPS32 = 2.0**-23
E4M3 = torch.float8_e4m3fn


test_interpreter_subprocess = interpreter_subprocess_test(__file__)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def make_state(n, p_dt, g_dt, m_dt, v_dt, seed=0, device="cpu"):
    """Random (param, grad, m, v, m_scales) with realistic magnitudes (v >= 0, m ~ 0.1 g scale)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(p_dt)
    g = torch.randn(n, generator=gen).to(g_dt)
    v = (torch.rand(n, generator=gen) * 0.1).to(v_dt)
    m32 = torch.randn(n, generator=gen) * 0.1
    scales = None
    if m_dt == E4M3:
        scales = torch.rand(m_scales_numel(n), generator=gen) * 1e-3 + 1e-4
        m = (m32 / scales.repeat_interleave(128)[:n]).clamp(-448, 448).to(E4M3)
    else:
        m = m32.to(m_dt)
    out = [p, g, m, v, scales]
    return [t.to(device) if t is not None else None for t in out]


def clone_all(state):
    return [t.clone() if t is not None else None for t in state]


# ------------------------------------------------------------------------------- vs torch.optim.AdamW
@pytest.mark.parametrize("lr,decay,grad_scale", [(1e-3, True, 1.0), (1e-2, False, 0.37), (1e-1, True, 1.0)])
def test_fp32_matches_torch_adamw(lr, decay, grad_scale):
    """Same math, different rounding order (torch: lerp for m, addcmul for v, p *= 1 - lr*wd, addcdiv).

    Bounds, T steps: p differs by <= ~2 ulp(p) per step from the two final roundings plus update error
    ~eps*lr, so |dp| <= 4*T*eps*(|p| + lr) (measured max 1.6*T*eps*(|p| + lr)); m = 0.9m + 0.1g can
    cancel, so its error is absolute, <= 2*eps*max|g| (measured 0.33); v sums positives, rel <= 8 eps
    (measured 2.9).
    """
    torch.manual_seed(0)
    n, steps, wd = 20000, 10, 0.1
    p0 = torch.randn(n)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd if decay else 0.0,
                            foreach=False, fused=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    gmax = 0.0
    for t in range(1, steps + 1):
        g = torch.randn(n) * (0.01 if t % 2 else 1.0)
        g[:100] = 0.0  # m = v = 0: update must be exactly 0 (+ decay)
        gmax = max(gmax, (g * grad_scale).abs().max().item())
        ref.grad = g * grad_scale
        opt.step()
        hp = AdamWHyper(lr=lr, step=t, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd, grad_scale=grad_scale)
        amax = adamw_update_(p, g, m, v, hp=hp, decay=decay, key=t)
        assert amax.dtype == torch.float32 and amax.dim() == 0 and amax.item() == p.abs().max().item()
    st = opt.state[ref]
    pr = ref.detach()
    assert bool(((p - pr).abs() <= 4 * steps * EPS32 * (pr.abs() + lr)).all()), (p - pr).abs().max()
    torch.testing.assert_close(m, st["exp_avg"], rtol=0, atol=2 * EPS32 * gmax)
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=8 * EPS32, atol=0)
    if not decay:
        assert torch.equal(p[:100], p0[:100])  # zero grad, no decay: untouched


# --------------------------------------------------------------------------- stochastic-rounding paths
@pytest.mark.parametrize("m_dt", [torch.bfloat16, torch.float32])
def test_bf16_states_are_fp32_math_then_sr_with_per_stream_keys(m_dt):
    """bf16 param/m/v == the fp32 update of the same values, then SR: param and m with the words of
    rng_key(key, PARAM_STREAM / M_STREAM) (round_to_bf16_sr); v with the high 16 bits of m's words when m is bf16
    (one hash for both, since v's streams were merged into m's), else with rng_key(key, V_STREAM)'s words."""
    n, key, off = 5000, rng_key(3, 4), 77
    p, g, m, v, _ = make_state(n, torch.bfloat16, torch.bfloat16, m_dt, torch.bfloat16, seed=1)
    p32, m32, v32 = (t.to(torch.float32, copy=True) for t in (p, m, v))
    hp = AdamWHyper(lr=3e-3, step=5, weight_decay=0.1, grad_scale=0.5)
    amax = adamw_update_(p, g, m, v, hp=hp, decay=True, key=key, offset=off)
    adamw_update_(p32, g, m32, v32, hp=hp, decay=True, key=key, offset=off)
    for got, want, stream in ((p, p32, PARAM_STREAM), (m, m32, M_STREAM)):
        if got.dtype == torch.bfloat16:
            assert torch.equal(bits(got), bits(round_to_bf16_sr(want, key=rng_key(key, stream), offset=off))), stream
        else:
            assert torch.equal(got, want)
    if m_dt == torch.bfloat16:
        rand_m = random_u32_twin(rng_key(key, M_STREAM), torch.arange(off, off + n))
        want_v = bf16_bits_to_f32_twin(sr_bf16_bits_twin(v32, rand_m >> 16))
    else:
        want_v = round_to_bf16_sr(v32, key=rng_key(key, V_STREAM), offset=off)
    assert torch.equal(bits(v), bits(want_v))
    assert amax.item() == p.float().abs().max().item()


def _twin_step(dtypes, **keys):
    """One adamw_step_twin of a fixed state with the given stream keys; returns the stored (p, m, v) bits."""
    state = make_state(3000, torch.bfloat16, torch.bfloat16, *dtypes, seed=6)
    p, g, m, v, s = state
    adamw_step_twin(p, g, m, v, s, lr=1e-2, beta1=0.9, one_minus_beta1=0.1, beta2=0.95, one_minus_beta2=0.05,
                    bias_corr1=1 - 0.9**3, bias_corr2=1 - 0.95**3, eps=1e-8, weight_decay=0.1, grad_scale=1.0,
                    offset=5, **{"key_param": 1, "key_m": 2, "key_v": 3, **keys})
    return bits(p), bits(m), bits(v)


def test_bf16_m_and_v_draw_the_two_halves_of_one_hash():
    """With bf16 m and v, key_v is unused (v rounds with the high half of m's word): changing it changes no bit;
    changing key_m changes m and v, key_param only the param. With an e4m3 m (20 of the word's bits) or an fp32
    m, v keeps its own stream."""
    bf16 = (torch.bfloat16, torch.bfloat16)
    base = _twin_step(bf16)
    assert all(torch.equal(x, y) for x, y in zip(base, _twin_step(bf16, key_v=99)))
    p, m, v = _twin_step(bf16, key_m=99)
    assert torch.equal(p, base[0]) and not torch.equal(m, base[1]) and not torch.equal(v, base[2])
    p, m, v = _twin_step(bf16, key_param=99)
    assert not torch.equal(p, base[0]) and torch.equal(m, base[1]) and torch.equal(v, base[2])
    for m_dt in (E4M3, torch.float32):
        base = _twin_step((m_dt, torch.bfloat16))
        p, m, v = _twin_step((m_dt, torch.bfloat16), key_v=99)
        assert torch.equal(p, base[0]) and torch.equal(m, base[1]) and not torch.equal(v, base[2]), m_dt


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated toward zero, next bf16 away from zero) of fp32 ``x``, as float64."""
    lo = (x.view(torch.int32) & -65536).view(torch.float32)  # clear the low 16 bits: toward zero
    hi = (lo.view(torch.int32) + 65536).view(torch.float32)
    return lo.double(), hi.double()


def test_sr_of_m_and_v_is_unbiased_and_their_roundings_uncorrelated():
    """One step of bf16 m and v from a fixed state under K keys: each stored value is one of the two bf16
    neighbours of the fp32 result (the same for every key) and, as a fraction of their spacing, the error
    e = (stored - fp32) / (hi - lo) has mean 0 per element if SR is unbiased, |e| < 1, variance <= 1/4.
    Over N = n * K draws (independent words: distinct counters and keys) the mean of e has sd <= 1 / (2 sqrt N)
    = 0.0016 (n = 2048, K = 48); we allow 5 sd, 0.008 (measured: a 15-bit threshold gives 0.25 for v, a
    truncation would be ~0.5). m's and v's errors share one hash word (its two halves); independent halves give
    E[e_m e_v] = 0 with sd <= 1 / (4 sqrt N) = 0.0008, allowed 0.004, where the same 16 bits for both (comonotone
    decisions) measure 0.083."""
    n, n_keys = 2048, 48
    state = make_state(n, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, seed=7)
    hp = AdamWHyper(lr=1e-3, step=3, grad_scale=0.5)
    p, g, m, v, _ = clone_all(state)
    m32, v32 = m.float(), v.float()
    adamw_update_(p, g, m32, v32, hp=hp, decay=True, key=0)  # the fp32 values that bf16 m, v round
    bounds = [_bf16_neighbours(x) for x in (m32, v32)]
    errs = []
    for key in range(n_keys):
        p, g, m, v, _ = clone_all(state)
        adamw_update_(p, g, m, v, hp=hp, decay=True, key=key)
        e = []
        for got, want, (lo, hi) in zip((m, v), (m32, v32), bounds):
            got = got.double()
            assert bool(((got == lo) | (got == hi)).all())
            e.append((got - want.double()) / (hi - lo))
        errs.append(torch.stack(e))
    e_m, e_v = torch.stack(errs, dim=1)  # (n_keys, n) each
    sd = 1 / (2 * (n * n_keys) ** 0.5)
    assert abs(e_m.mean().item()) < 5 * sd and abs(e_v.mean().item()) < 5 * sd, (e_m.mean(), e_v.mean())
    assert abs((e_m * e_v).mean().item()) < 5 * sd / 2, (e_m * e_v).mean()


def test_e4m3_m_within_one_step_unbiased_and_scaled_to_448():
    n = 128 * 6 + 37  # partial last block
    state = make_state(n, torch.float32, torch.float32, E4M3, torch.float32, seed=2)
    hp = AdamWHyper(lr=1e-3, step=2)
    # fp32 m reference from the same dequantized starting m
    p, g, m, v, scales = state
    m_old = e4m3_bits_to_f32_twin(bits(m).to(torch.int64)) * scales.repeat_interleave(128)[:n]
    p32, m32, v32 = p.clone(), m_old.clone(), v.clone()
    adamw_update_(p32, g, m32, v32, hp=hp, decay=True, key=0)
    deq_sum = torch.zeros(n)
    n_keys = 64
    for k in range(n_keys):
        p1, g1, m1, v1, s1 = clone_all(state)
        adamw_update_(p1, g1, m1, v1, hp=hp, decay=True, key=k, m_scales=s1)
        assert torch.equal(p1, p32) and torch.equal(v1, v32)  # fp32 param/v unaffected by m's format
        blk = torch.zeros(m_scales_numel(n) * 128)
        blk[:n] = m32.abs()
        assert torch.equal(s1, blk.view(-1, 128).amax(1) / 448.0)  # scale = block abs-max / 448
        deq = e4m3_bits_to_f32_twin(bits(m1).to(torch.int64)) * s1.repeat_interleave(128)[:n]
        # SR picks one of the two e4m3 neighbours: error < spacing <= 2**-3 |y| (normals), 2**-9 (subnormals)
        step = torch.maximum(m32.abs() * 2.0**-3, 2.0**-9 * s1.repeat_interleave(128)[:n]) * 1.0001
        assert bool(((deq - m32).abs() <= step).all())
        deq_sum += deq
    # unbiased: each element's mean over 64 keys within 5 sd of a two-point distribution (sd <= step/2)
    assert bool(((deq_sum / n_keys - m32).abs() <= 5 * step / 2 / n_keys**0.5 + 1e-12).all())


def test_abs_max_is_of_stored_param():
    for p_dt in (torch.float32, torch.bfloat16):
        p, g, m, v, _ = make_state(999, p_dt, torch.float32, torch.float32, torch.float32, seed=3)
        p[500] = -40.0
        amax = adamw_update_(p, g, m, v, hp=AdamWHyper(lr=1e-2, step=1), decay=True, key=1)
        assert amax.item() == p.float().abs().max().item() and amax.item() > 39
    empty = [torch.zeros(0) for _ in range(4)]
    assert adamw_update_(*empty, hp=AdamWHyper(lr=1.0, step=1), decay=True, key=0).item() == 0.0


# ---------------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("dtypes,cuts", [
    ((torch.float32,) * 4, [0, 1, 1000, 4000, 5003]),
    ((torch.bfloat16,) * 4, [0, 1, 1000, 4000, 5003]),
    ((torch.bfloat16, torch.float16, torch.bfloat16, torch.float32), [0, 999, 5003]),
    ((torch.bfloat16, torch.bfloat16, E4M3, torch.bfloat16), [0, 128, 2048, 4992, 5003]),  # e4m3: 128-aligned
])
def test_sharded_update_with_offsets_is_bit_identical(dtypes, cuts):
    n = cuts[-1]
    state = make_state(n, *dtypes, seed=4)
    hp = AdamWHyper(lr=1e-2, step=3, grad_scale=0.8)
    full = clone_all(state)
    amax_full = adamw_update_(*full[:4], hp=hp, decay=True, key=9, m_scales=full[4])
    shard = clone_all(state)
    p, g, m, v, s = shard
    amaxes = []
    for a, b in zip(cuts, cuts[1:]):
        ms = s[a // 128: -(-b // 128)] if s is not None else None
        amaxes.append(adamw_update_(p[a:b], g[a:b], m[a:b], v[a:b], hp=hp, decay=True, key=9, offset=a, m_scales=ms))
    for x, y in zip(full, shard):
        if x is not None:
            assert torch.equal(bits(x), bits(y))
    assert max(x.item() for x in amaxes) == amax_full.item()


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 4, (torch.bfloat16,) * 4,
                                    (torch.bfloat16, torch.bfloat16, E4M3, torch.bfloat16)])
def test_twin_in_pieces_is_bit_identical_to_one_call(dtypes, monkeypatch):
    """On the CPU the twin runs in TWIN_CHUNK pieces (its temporaries are host memory): same bits, same
    abs-max, for fp32, bf16-SR and e4m3 m (pieces are multiples of the 128-element blocks)."""
    from qtrain.kernels import adamw as kernel
    n, hp = 5003, AdamWHyper(lr=1e-2, step=3, grad_scale=0.8)
    state = make_state(n, *dtypes, seed=5)
    whole, pieces = clone_all(state), clone_all(state)
    amax_whole = adamw_update_(*whole[:4], hp=hp, decay=True, key=11, offset=77, m_scales=whole[4])
    monkeypatch.setattr(kernel, "TWIN_CHUNK", 256)
    amax_pieces = adamw_update_(*pieces[:4], hp=hp, decay=True, key=11, offset=77, m_scales=pieces[4])
    for x, y in zip(whole, pieces):
        if x is not None:
            assert torch.equal(bits(x), bits(y))
    assert amax_pieces.item() == amax_whole.item()


# ------------------------------------------------------------------------------- the tiny-lr stall
def test_bf16_sr_tracks_fp32_where_round_to_nearest_stalls():
    """Constant gradient: Adam moves every param by lr = 1e-4 per step, far below half a bf16 ulp in [1, 2)
    (2**-8). bf16 with round-to-nearest never moves; with SR the mean follows fp32. Each step's SR error
    has variance <= ulp**2/4 and steps use independent keys, so after 500 steps an element's error has
    sd <= sqrt(500) * 2**-8 = 0.087 and the mean over 2048 elements sd <= 0.0019; we allow 0.01 (5 sd)
    against a drift of 0.05.
    """
    n, steps, lr = 2048, 500, 1e-4
    torch.manual_seed(5)
    p_init = (1 + torch.rand(n)).bfloat16()
    g = torch.ones(n)
    p32, p_sr, p_rn = p_init.float(), p_init.clone(), p_init.clone()
    st32, st_sr, st_rn = ([torch.zeros(n), torch.zeros(n)] for _ in range(3))
    for t in range(1, steps + 1):
        hp = AdamWHyper(lr=lr, step=t, weight_decay=0.0)
        adamw_update_(p32, g, *st32, hp=hp, decay=False, key=t)
        adamw_update_(p_sr, g, *st_sr, hp=hp, decay=False, key=t)
        tmp = p_rn.float()
        adamw_update_(tmp, g, *st_rn, hp=hp, decay=False, key=t)
        p_rn = tmp.bfloat16()  # round to nearest
    drift = (p_init.float() - p32).mean().item()
    assert abs(drift - steps * lr) < 1e-4
    assert torch.equal(p_rn, p_init)  # stalled
    assert abs((p_sr.float() - p32).mean().item()) < 0.01


# ---------------------------------------------------------------------------------------- argument checks
def test_argument_errors():
    z = torch.zeros(256)
    hp = AdamWHyper(lr=1e-3, step=1)
    with pytest.raises(TypeError, match=r"unsupported dtypes.*param=torch.float16"):
        adamw_update_(z.half(), z, z, z, hp=hp, decay=True, key=0)
    with pytest.raises(TypeError, match=r"unsupported dtypes.*v=torch.float8_e4m3fn"):
        adamw_update_(z, z, z, z.to(E4M3), hp=hp, decay=True, key=0)
    with pytest.raises(ValueError, match="pass m_scales"):
        adamw_update_(z, z, z.to(E4M3), z, hp=hp, decay=True, key=0)
    with pytest.raises(ValueError, match="2 elements"):
        adamw_update_(z, z, z.to(E4M3), z, hp=hp, decay=True, key=0, m_scales=torch.zeros(3))
    with pytest.raises(ValueError, match="only for a float8"):
        adamw_update_(z, z, z, z, hp=hp, decay=True, key=0, m_scales=torch.zeros(2))
    with pytest.raises(ValueError, match="elements"):
        adamw_update_(z, z[:10], z, z, hp=hp, decay=True, key=0)
    with pytest.raises(ValueError, match="contiguous"):
        adamw_update_(z, z, z, torch.zeros(256, 2)[:, 0], hp=hp, decay=True, key=0)
    with pytest.raises(ValueError, match="1-based"):
        AdamWHyper(lr=1e-3, step=0)
    with pytest.raises(ValueError, match="beta2"):
        AdamWHyper(lr=1e-3, step=1, beta2=1.0)


# ------------------------------------------------------------------------------------ Triton == twin
COMBOS = [
    (torch.float32, torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32),
    (torch.float32, torch.float16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, E4M3, torch.bfloat16),
    (torch.float32, torch.float32, E4M3, torch.float32),
]


def _check_triton_vs_twin(device, sizes, steps=2):
    for combo in COMBOS:
        for n in sizes:
            state = make_state(n, *combo, seed=n, device=device)
            a, b = clone_all(state), clone_all(state)
            for t in range(1, steps + 1):
                hp = AdamWHyper(lr=1e-2, step=t, weight_decay=0.1, grad_scale=0.7)
                # counters straddle 2**32 (both words hashed in-kernel) or share a high word (absorbed on host)
                decay, off = t % 2 == 1, [2**32 - 300, 2**33 + 11][t % 2]
                with dispatch.backend("triton"):
                    amax_a = adamw_update_(*a[:4], hp=hp, decay=decay, key=t, offset=off, m_scales=a[4])
                with dispatch.backend("twin"):
                    amax_b = adamw_update_(*b[:4], hp=hp, decay=decay, key=t, offset=off, m_scales=b[4])
                for name, x, y in zip("pgmvs", a, b):
                    if x is not None:
                        assert torch.equal(bits(x), bits(y)), (combo, n, t, name)
                assert torch.equal(bits(amax_a), bits(amax_b)), (combo, n, t)


def _check_device_grad_scale(device):
    """A 0-dim tensor grad_scale (the clipping factor computed on the device) gives the bits of the same
    float; a NaN one skips the step: nothing written, abs-max 0."""
    for combo in COMBOS:
        state = make_state(1000, *combo, seed=3, device=device)
        a, b, c = clone_all(state), clone_all(state), clone_all(state)
        hp_f = AdamWHyper(lr=1e-2, step=2, weight_decay=0.1, grad_scale=0.375)
        hp_t = AdamWHyper(lr=1e-2, step=2, weight_decay=0.1, grad_scale=torch.tensor(0.375, device=device))
        hp_nan = AdamWHyper(lr=1e-2, step=2, weight_decay=0.1, grad_scale=torch.tensor(float("nan"), device=device))
        amax_a = adamw_update_(*a[:4], hp=hp_f, decay=True, key=9, offset=5, m_scales=a[4])
        amax_b = adamw_update_(*b[:4], hp=hp_t, decay=True, key=9, offset=5, m_scales=b[4])
        amax_c = adamw_update_(*c[:4], hp=hp_nan, decay=True, key=9, offset=5, m_scales=c[4])
        for name, x, y, z, s0 in zip("pgmvs", a, b, c, state):
            if x is not None:
                assert torch.equal(bits(x), bits(y)), (combo, name)
                assert torch.equal(bits(z), bits(s0)), (combo, name, "skipped step wrote")
        assert torch.equal(bits(amax_a), bits(amax_b)) and amax_c.item() == 0.0


def test_device_grad_scale_twin():
    with dispatch.backend("twin"):
        _check_device_grad_scale("cpu")


@interp_only
def test_interp_device_grad_scale():
    with dispatch.backend("triton"):
        _check_device_grad_scale("cpu")


@pytest.mark.gpu
@needs_cuda
def test_gpu_device_grad_scale():
    _check_device_grad_scale("cuda")


@interp_only
def test_interp_triton_matches_twin():
    _check_triton_vs_twin("cpu", sizes=[1, 128, 4101])


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_matches_twin():
    _check_triton_vs_twin("cuda", sizes=[1, 129, 2048 * 3 + 5, 2**20 + 77], steps=3)


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_matches_cpu_twin():
    """The CUDA kernel gives the CPU twin's bits (IEEE div/sqrt, no FMA on both sides)."""
    for combo in COMBOS:
        state = make_state(70001, *combo, seed=7)
        cpu, gpu = clone_all(state), [t.cuda() if t is not None else None for t in state]
        hp = AdamWHyper(lr=1e-2, step=4, grad_scale=0.9)
        adamw_update_(*cpu[:4], hp=hp, decay=True, key=5, offset=3, m_scales=cpu[4])
        adamw_update_(*gpu[:4], hp=hp, decay=True, key=5, offset=3, m_scales=gpu[4])
        for x, y in zip(cpu, gpu):
            if x is not None:
                assert torch.equal(bits(x), bits(y).cpu()), combo


ADAMW_SIG = {"p_ptr": "*i16", "g_ptr": "*i16", "m_ptr": "*i16", "v_ptr": "*i16", "ms_ptr": "*fp32", "amax_ptr": "*i32",
             "n": "i64", "offset": "i64", "ks_p": "i32", "ks_m": "i32", "ks_v": "i32", **dict.fromkeys(
                 ("lr", "beta1", "omb1", "beta2", "omb2", "ibc1", "ibc2", "eps", "wd", "grad_scale"), "fp32"),
             "gs_ptr": "*fp32"}
FMIX_C1 = "-2048144789"  # Murmur's first finaliser multiplier 0x85EBCA6B as PTX writes the immediate: once per hash


@pytest.mark.skipif(not dispatch.HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("kinds,hashes", [((1, 1, 1, 1), 2), ((1, 1, 3, 1), 3), ((0, 0, 0, 0), 0)])
def test_kernel_work_per_element_for_hopper(kinds, hashes):
    """The sm_90 build (the kernel is issue-bound on H100/H200) does, per element: one IEEE division and one
    sqrt (the bias corrections are multiplies by reciprocals), `hashes` Murmur words (bf16 param, m, v: two, m and
    v sharing one; an e4m3 m needs its own 20 bits, so three), and no FMA (fp fusion off: the twin's roundings)."""
    from qtrain.kernels import adamw as kernel
    from tests.triton_interp import compile_for_hopper

    ptr = {0: "*fp32", 1: "*i16", 3: "*u8"}
    sig = {**ADAMW_SIG, **{f"{t}_ptr": ptr[k] for t, k in zip("pgmv", kinds)}}
    const = dict(zip(("P_KIND", "G_KIND", "M_KIND", "V_KIND"), kinds), HI_ABSORBED=True, ROWS=kernel.ROWS,
                 GS_PTR=False)
    ptx = compile_for_hopper(kernel._adamw_kernel, sig, const, num_warps=kernel.NUM_WARPS, enable_fp_fusion=False)
    per_thread = kernel.ROWS * kernel.M_BLOCK // (32 * kernel.NUM_WARPS)
    assert ptx.count("sqrt.rn.f32") == per_thread and ptx.count(FMIX_C1) == hashes * per_thread
    if kinds[2] != 3:  # an e4m3 m also divides once per 128-element block for its scale
        assert ptx.count("div.rn.f32") == per_thread
    assert "fma.rn" not in ptx


def test_twin_signature_is_the_kernel_contract():
    """adamw_step_twin is what the CPU path runs; the Triton launcher has the same keyword contract, plus its launch
    shape (rows, num_warps: defaults the kernel module's, which change no bit)."""
    import inspect

    from qtrain.kernels.adamw import NUM_WARPS, ROWS, adamw_step_triton

    launcher = inspect.signature(adamw_step_triton)
    shape = {n: p.default for n, p in launcher.parameters.items() if n in ("rows", "num_warps")}
    assert shape == {"rows": ROWS, "num_warps": NUM_WARPS}
    contract = launcher.replace(parameters=[p for n, p in launcher.parameters.items() if n not in shape])
    assert inspect.signature(adamw_step_twin) == contract
