"""Fused AdamW (qtrain/numerics/adamw.py over qtrain/kernels/adamw.py): against torch.optim.AdamW, SR
composition, e4m3 m, sharded offsets, the bf16 tiny-lr stall, and twin == Triton bit for bit.

``test_interpreter_subprocess`` re-runs this file's ``test_interp_*`` tests with TRITON_INTERPRET=1.
"""


import pytest
import torch

from tests.triton_interp import interp_only, interpreter_subprocess_test, needs_cuda
from qtrain.kernels import dispatch
from qtrain.kernels.adamw import adamw_step_twin
from qtrain.kernels.rng import rng_key
from qtrain.kernels.stochastic_rounding import e4m3_bits_to_f32_twin, round_to_bf16_sr
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
def test_bf16_states_are_fp32_math_then_sr_with_per_stream_keys():
    """bf16 param/m/v == the fp32 update of the same values, then round_to_bf16_sr with rng_key(key, stream)."""
    n, key, off = 5000, rng_key(3, 4), 77
    p, g, m, v, _ = make_state(n, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, seed=1)
    p32, m32, v32 = p.float(), m.float(), v.float()
    hp = AdamWHyper(lr=3e-3, step=5, weight_decay=0.1, grad_scale=0.5)
    amax = adamw_update_(p, g, m, v, hp=hp, decay=True, key=key, offset=off)
    adamw_update_(p32, g, m32, v32, hp=hp, decay=True, key=key, offset=off)
    for got, want, stream in ((p, p32, PARAM_STREAM), (m, m32, M_STREAM), (v, v32, V_STREAM)):
        assert torch.equal(bits(got), bits(round_to_bf16_sr(want, key=rng_key(key, stream), offset=off))), stream
    assert amax.item() == p.float().abs().max().item()


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
