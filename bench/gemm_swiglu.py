"""Kind `gemm-swiglu`: can a Triton GEMM with the SwiGLU fused into its epilogue beat cuBLAS + a separate SwiGLU
kernel on the H200 (sm_90) at Qwen2.5 MLP shapes? An experiment: nothing in qtrain/ uses these kernels.

Forward. x (M, H) bf16, W (2F, H) bf16 (the fused up/gate nn.Linear weight: rows [0, F) make `up`, rows [F, 2F)
`gate`); u = x @ W^T = [up | gate] (M, 2F), h = up * silu(gate) (M, F), silu in fp32 from the bf16 u, rounded once.
  baseline: torch.mm(x, W.t()) (cuBLAS), then torch.compile'd `silu(gate) * up` (what qtrain's block does)
  fused:    one persistent TMA kernel; a program's tile (rows, columns [n0, n0 + BN)) keeps two fp32
            accumulators, from W rows [n0, n0 + BN) (up) and [F + n0, F + n0 + BN) (gate), and its epilogue
            stores both halves of u (backward needs it) and h
  h-only:   the same kernel writing only h (what a recompute-the-MLP mode would need): the ceiling
Backward. dY (M, H) (the down projection's output gradient), W_down (H, F); dh = dY @ W_down (M, F) is d(h).
  baseline: torch.mm(dY, W_down), then qtrain's swiglu_backward(dh, u) (Triton) -> du = [d_up | d_gate] (M, 2F)
  fused:    one persistent TMA GEMM whose epilogue rounds its dh tile to bf16 (the baseline's bits), loads the
            matching up and gate tiles of u and writes both halves of du; dh is never written

Each fused kernel is swept over a small set of launch configs (FWD_CONFIGS / BWD_CONFIGS; every config is
compiled and timed, so keep them few): the plain builds first, then the warp-specialized ones (Triton's sm_90
pass; an error that loses the CUDA context there ends the sweep and the result keeps what was measured, with
`cuda_lost`). Each config's first output is checked against the baseline's over the whole tensor (`_close`: a
wrong tile or half is O(1) off, the rounding differences ~1e-3) and only a passing config can be the best.
Timing: triton.testing.do_bench (L2 flushed before each call, mean ms).

Finer checks with the best configs (on the first/last CHECK_ROWS rows, against fp32 references computed by torch
from the same bf16 inputs):
  u:  |u - ref| of the fused kernel against cuBLAS's: both round an fp32 accumulation to bf16, so both errors are
      ~half a bf16 ulp of |u|, plus the fp32 summation error (either order: ~sqrt(K) * 2^-24 relative, far
      smaller); the fused kernel passes when its max error <= 2 x cuBLAS's and its mean error <= 1.25 x cuBLAS's.
  h:  the fused h against the baseline's compiled SwiGLU applied to the fused u (the same inputs): at most 1 bf16
      ulp apart (the exp implementation and fp32 op order may differ by a few fp32 ulps before the one rounding),
      and the h-only build's h bit-equal to the full one's at the same config.
  du: both against swiglu_backward_twin(dh_ref rounded to bf16, u) with dh_ref the fp32 product: the fused max
      error <= 2 x the baseline's (+ 1e-6 abs), or its max relative error (floored at 2^-8 of du's rms)
      <= 2^-6 (a dh rounded to the other neighbour moves du by 2^-7 at most); the share of du bit-equal to the
      baseline's is printed (where dh's bf16 rounding flips between the two accumulation orders, du differs by an ulp
      or two).

Parameters: M (65536), H (896), F (4864) (defaults: Qwen2.5-0.5B at one micro-batch of 65536 tokens; 1.5B is
M=32768 H=1536 F=8960, 3B M=32768 H=2048 F=11008, 7B M=8192 H=3584 F=18944; F must be a multiple of the configs'
BN: 64 at least), warmup (25), rep (100): do_bench's ms; configs ("plain" (default): the builds without warp
specialization; "all"; or a list of names from FWD_CONFIGS / BWD_CONFIGS), check (True: the finer checks). The
warp-specialized builds never finished on the H200 (session 23: the 0.5B case, killed by its 300 s timeout in
their section, after the plain builds' rows), hence not by default.
Result: `rows` (one per timed thing: name, ms, TFLOP/s for GEMMs, x of the baseline, check), `fwd_ratio` and
`bwd_ratio` (best fused ms / baseline ms; < 1: the fusion wins), `fwd_honly_ratio`, `fwd_gemm_ratio` /
`bwd_gemm_ratio` (cuBLAS's GEMM alone / baseline: the floor an ideal fusion approaches), the best configs, the ms,
the check numbers (`checks_ok`) and `summary`.

CPU: `TRITON_INTERPRET=1 python3 -m bench.gemm_swiglu` runs both kernels at a tiny shape in the interpreter (bf16
dots in fp32 there, bf16 rounding by bits: the interpreter's own are wrong / truncating) against torch.
"""
from __future__ import annotations

import os
import time
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.kinds import Skip

# -------------------------------------------------------------------------------------------------- configs
class Cfg(NamedTuple):
    """One launch config. BN is per accumulator: the forward's tile is BM x 2BN of u (up and gate) plus BM x BN of
    h. sub: the epilogue in `sub` column slices (halves the TMA staging tiles in shared memory). ws: Hopper warp
    specialization (tl.range(warp_specialize=True) on the persistent loop, not flattened: Triton 3.6's sm_90 pass
    then runs 1 producer warpgroup (TMA) and 2 consumer warpgroups of `warps` = 4 each, splitting BM; it does not
    take descriptor stores or loads in the epilogue, so ws goes with ptr). ptr: the epilogue loads and stores
    through pointers from the accumulator's registers instead of TMA (no shared-memory staging)."""
    BM: int
    BN: int
    BK: int
    stages: int
    warps: int
    sub: int = 1
    ws: bool = False
    ptr: bool = False


# sm_90 builds (Triton 3.6 and its ptxas, on the CPU, at 16-divisible shapes): shared memory KB / registers per
# thread, no spills unless noted. forward (u and h; h only): f128x128-s3 160 / 188 (199); -s4 208 / 186 (197);
# f128x64-s4 144 / 110; -s3-ptr 160 / 252 (184); ws: 12 warps, setmaxnreg 232 for the consumers: f128x64-s4-ws
# 208 (144 h only); f128x128-s3-ws 208 with a 736-byte spill stack (160 and none h only). backward: b128x128-s4
# 192 / 149; b128x256-s3 208 / 255, 8-byte stack; -s4-ptr 160 / 163; ws 144 (s4), 208 (s6), 160 (b128x64-s6).
# Left out: b128x256-s4 (256 KB > 227 KB), pointer epilogues with 64-bit offsets or without the column split
# (600-3500-byte spills), ws with a column split (the pass fails) or with TMA epilogues (it does not split them).
FWD_CONFIGS = {
    "f128x128x64-s3": Cfg(128, 128, 64, 3, 8, sub=2),
    "f128x128x64-s4": Cfg(128, 128, 64, 4, 8, sub=2),
    "f128x64x64-s4": Cfg(128, 64, 64, 4, 8),
    "f128x128x64-s3-ptr": Cfg(128, 128, 64, 3, 8, sub=2, ptr=True),
    "f128x64x64-s4-ws": Cfg(128, 64, 64, 4, 4, ws=True, ptr=True),
    "f128x128x64-s3-ws": Cfg(128, 128, 64, 3, 4, ws=True, ptr=True),
}
BWD_CONFIGS = {
    "b128x128x64-s4": Cfg(128, 128, 64, 4, 8),
    "b128x256x64-s3": Cfg(128, 256, 64, 3, 8, sub=2),
    "b128x128x64-s4-ptr": Cfg(128, 128, 64, 4, 8, ptr=True),
    "b128x128x64-s4-ws": Cfg(128, 128, 64, 4, 4, ws=True, ptr=True),
    "b128x128x64-s6-ws": Cfg(128, 128, 64, 6, 4, ws=True, ptr=True),
    "b128x64x64-s6-ws": Cfg(128, 64, 64, 6, 4, ws=True, ptr=True),
}
GROUP_M = 8
DEVICE = "cuda"  # run()'s device (a scratch test of run()'s flow under the interpreter sets "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CHECK_ROWS = 2048


# -------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP: tl.constexpr):
    """Grouped order: GROUP row blocks walk the column blocks together, so W's tiles are reused from L2."""
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _grid(M, F, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """(num_pid_m, k_tiles, num_tiles, num_pid_in_group) of an (M, F) output over K, in BM x BN tiles."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = F // BN
    return num_pid_m, tl.cdiv(K, BK), num_pid_m * num_pid_n, GROUP * num_pid_n


@triton.jit
def _mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b; INTERP (Triton's interpreter, whose bf16 tl.dot returns garbage): in fp32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _bf16(x, INTERP: tl.constexpr):
    """fp32 -> bf16, round to nearest even: the GPU's cvt.rn; INTERP: by the bit pattern (the interpreter's
    conversion truncates)."""
    if INTERP:
        b = x.to(tl.uint32, bitcast=True)
        rn = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return rn.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _silu_mul(up, gate, INTERP: tl.constexpr):
    """h = silu(gate) * up from the bf16 up/gate tiles, in fp32, rounded once (inductor's order: (g * s) * up)."""
    g = gate.to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    return _bf16((g * s) * up.to(tl.float32), INTERP)


@triton.jit
def _tile_ptrs(ptr, om, on, M, ROW_STRIDE, BM: tl.constexpr, BN: tl.constexpr):
    """Pointers to a BM x BN tile at (om, on) of a row-major matrix (a 64-bit scalar base, 32-bit offsets within the
    tile: fewer registers than 64-bit offsets per element) and its row mask."""
    base = ptr + om.to(tl.int64) * ROW_STRIDE + on
    rows = tl.arange(0, BM)
    return base + rows[:, None] * ROW_STRIDE + tl.arange(0, BN)[None, :], (om + rows < M)[:, None]


@triton.jit
def _fwd_epilogue(acc_u, acc_g, u_desc, h_desc, u_ptr, h_ptr, om, on, M, F, WRITE_U: tl.constexpr,
                  PTR: tl.constexpr, INTERP: tl.constexpr):
    up = _bf16(acc_u, INTERP)
    gate = _bf16(acc_g, INTERP)
    h = _silu_mul(up, gate, INTERP)
    if PTR:
        BM: tl.constexpr = acc_u.shape[0]
        BN: tl.constexpr = acc_u.shape[1]
        if WRITE_U:
            p, mask = _tile_ptrs(u_ptr, om, on, M, 2 * F, BM, BN)
            tl.store(p, up, mask=mask)
            tl.store(p + F, gate, mask=mask)
        p, mask = _tile_ptrs(h_ptr, om, on, M, F, BM, BN)
        tl.store(p, h, mask=mask)
    else:  # TMA: rows past M are clipped
        if WRITE_U:
            u_desc.store([om, on], up)
            u_desc.store([om, F + on], gate)
        h_desc.store([om, on], h)


@triton.jit
def _fwd_kernel(x_desc, w_desc, u_desc, h_desc, u_ptr, h_ptr, M, F, K,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, NUM_SMS: tl.constexpr,
                WRITE_U: tl.constexpr, EPI_SUB: tl.constexpr, WS: tl.constexpr, PTR: tl.constexpr,
                FLAT: tl.constexpr, INTERP: tl.constexpr):
    """u = x @ W^T and h = up * silu(gate), persistent: program p takes tiles p, p + NUM_SMS, ... F % BN == 0."""
    start_pid = tl.program_id(0)
    num_pid_m, k_tiles, num_tiles, num_pid_in_group = _grid(M, F, K, BM, BN, BK, GROUP)
    tile_id_c = start_pid - NUM_SMS  # the epilogue's own counter (as Triton's persistent matmul tutorial)
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP)
        om = pid_m * BM
        on = pid_n * BN
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            ok = ki * BK
            a = x_desc.load([om, ok])
            b_up = w_desc.load([on, ok])
            b_gate = w_desc.load([F + on, ok])
            acc_u = _mma(a, b_up.T, acc_u, INTERP)
            acc_g = _mma(a, b_gate.T, acc_g, INTERP)
        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP)
        om = pid_m * BM
        on = pid_n * BN
        if EPI_SUB == 2:  # two column halves: half the TMA staging tiles in shared memory
            u0, u1 = tl.split(tl.permute(tl.reshape(acc_u, (BM, 2, BN // 2)), (0, 2, 1)))
            g0, g1 = tl.split(tl.permute(tl.reshape(acc_g, (BM, 2, BN // 2)), (0, 2, 1)))
            _fwd_epilogue(u0, g0, u_desc, h_desc, u_ptr, h_ptr, om, on, M, F, WRITE_U, PTR, INTERP)
            _fwd_epilogue(u1, g1, u_desc, h_desc, u_ptr, h_ptr, om, on + BN // 2, M, F, WRITE_U, PTR, INTERP)
        else:
            _fwd_epilogue(acc_u, acc_g, u_desc, h_desc, u_ptr, h_ptr, om, on, M, F, WRITE_U, PTR, INTERP)


@triton.jit
def _bwd_epilogue(acc, u_desc, du_desc, u_ptr, du_ptr, om, on, M, F, PTR: tl.constexpr, INTERP: tl.constexpr):
    """du's two halves for one (rows, columns) tile of dh in fp32: qtrain's swiglu_backward formulas in its order,
    from dh rounded to bf16 first (the baseline's dh is a bf16 tensor)."""
    d = _bf16(acc, INTERP).to(tl.float32)
    if PTR:
        p, mask = _tile_ptrs(u_ptr, om, on, M, 2 * F, acc.shape[0], acc.shape[1])
        up = tl.load(p, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(p + F, mask=mask, other=0.0).to(tl.float32)
    else:
        up = u_desc.load([om, on]).to(tl.float32)
        gate = u_desc.load([om, F + on]).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-gate))
    d_up = _bf16(d * gate * s, INTERP)
    d_gate = _bf16(d * up * s * (1.0 + gate * (1.0 - s)), INTERP)
    if PTR:
        q, mask = _tile_ptrs(du_ptr, om, on, M, 2 * F, acc.shape[0], acc.shape[1])
        tl.store(q, d_up, mask=mask)
        tl.store(q + F, d_gate, mask=mask)
    else:
        du_desc.store([om, on], d_up)
        du_desc.store([om, F + on], d_gate)


@triton.jit
def _bwd_kernel(dy_desc, wd_desc, u_desc, du_desc, u_ptr, du_ptr, M, F, K,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, NUM_SMS: tl.constexpr,
                EPI_SUB: tl.constexpr, WS: tl.constexpr, PTR: tl.constexpr, FLAT: tl.constexpr,
                INTERP: tl.constexpr):
    """du = swiglu_backward(bf16(dY @ W_down), u), persistent as _fwd_kernel. F % BN == 0."""
    start_pid = tl.program_id(0)
    num_pid_m, k_tiles, num_tiles, num_pid_in_group = _grid(M, F, K, BM, BN, BK, GROUP)
    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            ok = ki * BK
            a = dy_desc.load([om, ok])
            b = wd_desc.load([ok, on])  # W_down (H, F) row-major: a (BK, BN) tile, F contiguous
            acc = _mma(a, b, acc, INTERP)
        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP)
        om = pid_m * BM
        on = pid_n * BN
        if EPI_SUB == 2:
            a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            _bwd_epilogue(a0, u_desc, du_desc, u_ptr, du_ptr, om, on, M, F, PTR, INTERP)
            _bwd_epilogue(a1, u_desc, du_desc, u_ptr, du_ptr, om, on + BN // 2, M, F, PTR, INTERP)
        else:
            _bwd_epilogue(acc, u_desc, du_desc, u_ptr, du_ptr, om, on, M, F, PTR, INTERP)


# ------------------------------------------------------------------------------------------------ launchers
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return int(os.environ.get("GEMM_SWIGLU_SMS", "3"))  # the interpreter: a few programs, several tiles each


def _common(c: Cfg, sms: int) -> dict:
    return dict(BM=c.BM, BN=c.BN, BK=c.BK, GROUP=GROUP_M, NUM_SMS=sms, EPI_SUB=c.sub, WS=c.ws, PTR=c.ptr,
                FLAT=not c.ws, INTERP=INTERPRET, num_warps=c.warps, num_stages=c.stages)


def fused_forward(x: torch.Tensor, w: torch.Tensor, c: Cfg, *, write_u: bool = True,
                  num_sms: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(u, h) (u None when write_u is False) for x (M, H) and w (2F, H), both bf16 row-major."""
    M, K = x.shape
    F = w.shape[0] // 2
    assert w.shape == (2 * F, K) and F % c.BN == 0 and x.is_contiguous() and w.is_contiguous(), (x.shape, w.shape, c)
    h = torch.empty(M, F, dtype=torch.bfloat16, device=x.device)
    u = torch.empty(M, 2 * F, dtype=torch.bfloat16, device=x.device) if write_u else None
    ub = u if write_u else h  # h-only: a placeholder the kernel never stores through
    sms = num_sms or _num_sms(x.device)
    n_tiles = triton.cdiv(M, c.BM) * (F // c.BN)
    _fwd_kernel[(min(sms, n_tiles),)](
        TensorDescriptor.from_tensor(x, [c.BM, c.BK]), TensorDescriptor.from_tensor(w, [c.BN, c.BK]),
        TensorDescriptor.from_tensor(ub, [c.BM, c.BN // c.sub]), TensorDescriptor.from_tensor(h, [c.BM, c.BN // c.sub]),
        ub, h, M, F, K, WRITE_U=write_u, **_common(c, sms))
    return u, h


def fused_backward(dy: torch.Tensor, wd: torch.Tensor, u: torch.Tensor, c: Cfg, *,
                   num_sms: int | None = None) -> torch.Tensor:
    """du (M, 2F) for dY (M, H), W_down (H, F) and u (M, 2F), all bf16 row-major."""
    M, K = dy.shape
    F = wd.shape[1]
    assert wd.shape == (K, F) and u.shape == (M, 2 * F) and F % c.BN == 0, (dy.shape, wd.shape, u.shape, c)
    assert dy.is_contiguous() and wd.is_contiguous() and u.is_contiguous()
    du = torch.empty_like(u)
    sms = num_sms or _num_sms(dy.device)
    n_tiles = triton.cdiv(M, c.BM) * (F // c.BN)
    _bwd_kernel[(min(sms, n_tiles),)](
        TensorDescriptor.from_tensor(dy, [c.BM, c.BK]), TensorDescriptor.from_tensor(wd, [c.BK, c.BN]),
        TensorDescriptor.from_tensor(u, [c.BM, c.BN // c.sub]), TensorDescriptor.from_tensor(du, [c.BM, c.BN // c.sub]),
        u, du, M, F, K, **_common(c, sms))
    return du


# ------------------------------------------------------------------------------------------------ references
def swiglu_ref(u: torch.Tensor) -> torch.Tensor:
    """qtrain's forward (qtrain.model.layers.swiglu); compiled in run()."""
    up, gate = u.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


def _bwd_twin(dh: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """swiglu_backward_twin's formulas (fp32 from bf16 dh and u, one rounding), local so the self-check needs no
    qtrain import under the interpreter."""
    up, gate = u.float().chunk(2, dim=-1)
    d = dh.float()
    s = torch.sigmoid(gate)
    return torch.cat([d * gate * s, d * up * s * (1 + gate * (1 - s))], dim=-1).to(u.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in bf16 units in the last place (through zero for mixed signs)."""
    def key(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return int((key(a) - key(b)).abs().max()) if a.numel() else 0


def _check_rows(M: int) -> torch.Tensor:
    n = min(CHECK_ROWS, M)
    return torch.unique(torch.cat([torch.arange(0, n), torch.arange(M - n, M)]))


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> tuple[bool, float]:
    """Whole-tensor agreement of two roundings of the same values: relative Frobenius distance <= rel (a wrong
    tile, a swapped half or a missed row is O(1)), and no element further off than 4 rel x max |want|."""
    g, w = got.float(), want.float()
    d = (torch.linalg.vector_norm(g - w) / torch.linalg.vector_norm(w).clamp_min(1e-30)).item()
    return d <= rel and (g - w).abs().max().item() <= 4 * rel * w.abs().max().item(), d


# ------------------------------------------------------------------------------------------------------ run
ROWS: list[dict] = []


def _line(name: str, t: float, flops: float = 0.0, ratio: float | None = None, **extra) -> dict:
    tf = flops / t / 1e9 if flops else None
    print(f"  {name:44s} {t:8.3f} ms" + (f" {tf:7.1f} TFLOP/s" if tf else " " * 16)
          + (f"  x{ratio:.3f} of baseline" if ratio is not None else "")
          + "".join(f"  {k}={v}" for k, v in extra.items()), flush=True)
    row = dict(name=name, ms=round(t, 4), **({"tflops": round(tf, 1)} if tf else {}),
               **({"ratio": round(ratio, 4)} if ratio is not None else {}), **extra)
    ROWS.append(row)
    return row


_STICKY = ("illegal memory access", "illegal instruction", "unspecified launch failure", "misaligned address",
           "device-side assert", "an illegal")


class _Sweep:
    """Compile, check (`verify(output) -> (ok, note)`) and time configs; a config that fails to build or launch (out
    of shared memory, say) is printed and skipped; a wrong one is timed but never the best. After an error that
    leaves the CUDA context unusable (an illegal address in a warp-specialized build, say) nothing more runs: `dead`
    is set and run() returns what it has."""

    def __init__(self, bench):
        self.bench = bench
        self.best: dict[str, tuple[str | None, float]] = {}
        self.dead: str | None = None

    def __call__(self, label: str, configs: dict, call, verify, flops: float, base_ms: float) -> None:
        best = self.best.setdefault(label, (None, float("inf")))
        for name, cfg in configs.items():
            if self.dead:
                return
            try:
                t0 = time.perf_counter()
                out = call(cfg)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                ok, note = verify(out)
                del out
                t = self.bench(lambda: call(cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not build or launch is a result too
                text = str(e).strip()
                msg = f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"
                print(f"  {label} {name}: FAILED {msg}", flush=True)
                ROWS.append(dict(name=f"{label} {name}", error=msg))
                if any(k in text.lower() for k in _STICKY):
                    self.dead = f"{label} {name}: {msg}"
                    print(f"  the CUDA context is lost: no more configs ({self.dead})", flush=True)
                continue
            _line(f"{label} {name}", t, flops, t / base_ms, check="ok" if ok else "WRONG", err=note,
                  first_call_s=round(first_s, 1))
            if ok and t < best[1]:
                best = (name, t)
            self.best[label] = best


def run(M: int = 65536, H: int = 896, F: int = 4864, warmup: int = 25, rep: int = 100,
        configs: str | list[str] = "plain", check: bool = True) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("gemm-swiglu needs a CUDA GPU")
    from qtrain.kernels.swiglu import swiglu_backward
    ROWS.clear()
    dev = torch.device(DEVICE)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    def chosen(name: str, cfg: Cfg) -> bool:
        return configs == "all" or (configs == "plain" and not cfg.ws) or name in configs
    fwd_cfgs = {k: v for k, v in FWD_CONFIGS.items() if chosen(k, v)}
    bwd_cfgs = {k: v for k, v in BWD_CONFIGS.items() if chosen(k, v)}
    for cfgs in (fwd_cfgs, bwd_cfgs):
        for k in [k for k, v in cfgs.items() if F % v.BN]:
            print(f"  skipping {k}: F={F} is not a multiple of BN={cfgs[k].BN}")
            del cfgs[k]
    if not fwd_cfgs or not bwd_cfgs:
        raise ValueError(f"no config left for F={F} among {configs}")

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep)

    g = torch.Generator(device=dev).manual_seed(0)
    # Linear-init-like scales: |u| ~ 1, |dh| ~ 1 (the checks are relative; the timings do not depend on values)
    x = torch.randn(M, H, device=dev, generator=g).bfloat16()
    w = (torch.randn(2 * F, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    dy = torch.randn(M, H, device=dev, generator=g).bfloat16()
    wd = (torch.randn(H, F, device=dev, generator=g) / H ** 0.5).bfloat16()
    fwd_flops, bwd_flops = 2.0 * M * 2 * F * H, 2.0 * M * F * H
    print(f"{torch.cuda.get_device_name()}: M={M} H={H} F={F}; forward u = x @ W^T ({fwd_flops / 1e12:.2f} TFLOP) "
          f"+ SwiGLU, backward dh = dY @ W_down ({bwd_flops / 1e12:.2f} TFLOP) + SwiGLU backward", flush=True)

    t0 = time.perf_counter()
    swiglu_c = torch.compile(swiglu_ref, dynamic=False)
    u_c = torch.mm(x, w.t())  # cuBLAS's u: the baseline's, and the backward's input
    h_c = swiglu_c(u_c)
    dh_c = torch.mm(dy, wd)
    du_c = swiglu_backward(dh_c, u_c)
    torch.cuda.synchronize()
    print(f"  (torch.compile of the SwiGLU: {time.perf_counter() - t0:.1f} s)")

    def baseline_fwd():
        return swiglu_c(torch.mm(x, w.t()))

    def baseline_bwd():
        return swiglu_backward(torch.mm(dy, wd), u_c)

    # per-config checks, whole tensors against the baseline's (the docstring's finer checks run on the best)
    def verify_fwd(out):
        u, h = out
        ok_h, dh = _close(h, h_c, 2 ** -7)
        if u is None:
            return ok_h, f"h {dh:.1e}"
        ok_u, du = _close(u, u_c, 2 ** -7)
        return ok_u and ok_h, f"u {du:.1e} h {dh:.1e}"

    def verify_bwd(du):
        ok, d = _close(du, du_c, 2 ** -7)
        return ok, f"du {d:.1e}"

    print("baselines:")
    t_mm = _line("fwd cuBLAS u = x @ W^T", bench(lambda: torch.mm(x, w.t())), fwd_flops)["ms"]
    _line("fwd compiled SwiGLU h = silu(gate) * up", bench(lambda: swiglu_c(u_c)))
    t_fb = _line("fwd baseline: cuBLAS + compiled SwiGLU", bench(baseline_fwd), fwd_flops)["ms"]
    t_bm = _line("bwd cuBLAS dh = dY @ W_down", bench(lambda: torch.mm(dy, wd)), bwd_flops)["ms"]
    _line("bwd qtrain swiglu_backward(dh, u)", bench(lambda: swiglu_backward(dh_c, u_c)))
    t_bb = _line("bwd baseline: cuBLAS + swiglu_backward", bench(baseline_bwd), bwd_flops)["ms"]

    # the plain builds first, the warp-specialized ones (Triton's experimental sm_90 pass) last
    sweep = _Sweep(bench)
    FU, HO, BW = "fwd fused u, h", "fwd fused h only", "bwd fused du"
    for ws in (False, True):
        print(f"fused kernels, {'warp-specialized' if ws else 'plain'} builds:")
        sel = {k: v for k, v in fwd_cfgs.items() if v.ws == ws}
        sweep(FU, sel, lambda c: fused_forward(x, w, c), verify_fwd, fwd_flops, t_fb)
        sweep(BW, {k: v for k, v in bwd_cfgs.items() if v.ws == ws},
              lambda c: fused_backward(dy, wd, u_c, c), verify_bwd, bwd_flops, t_bb)
        sweep(HO, sel, lambda c: fused_forward(x, w, c, write_u=False), verify_fwd, fwd_flops, t_fb)
    del h_c, dh_c, du_c
    (fb, t_f), (hb, t_h), (bb, t_b) = (sweep.best.get(k, (None, float("inf"))) for k in (FU, HO, BW))

    print("summary (ms; TFLOP/s of the GEMM's flops; x of the baseline):")
    _line("fwd baseline: cuBLAS + compiled SwiGLU", t_fb, fwd_flops, 1.0)
    _line("fwd cuBLAS GEMM alone", t_mm, fwd_flops, t_mm / t_fb)
    if fb:
        _line(f"fwd fused u, h: best {fb}", t_f, fwd_flops, t_f / t_fb, config=fb)
    if hb:
        _line(f"fwd fused h only: best {hb}", t_h, fwd_flops, t_h / t_fb, config=hb)
    _line("bwd baseline: cuBLAS + swiglu_backward", t_bb, bwd_flops, 1.0)
    _line("bwd cuBLAS GEMM alone", t_bm, bwd_flops, t_bm / t_bb)
    if bb:
        _line(f"bwd fused du: best {bb}", t_b, bwd_flops, t_b / t_bb, config=bb)

    def ratio(t, base):
        return round(t / base, 4) if t < float("inf") else None

    out = {"fwd_ratio": ratio(t_f, t_fb), "bwd_ratio": ratio(t_b, t_bb), "fwd_honly_ratio": ratio(t_h, t_fb),
           "fwd_gemm_ratio": round(t_mm / t_fb, 4), "bwd_gemm_ratio": round(t_bm / t_bb, 4),
           "fwd_config": fb, "fwd_honly_config": hb, "bwd_config": bb,
           "fwd_baseline_ms": t_fb, "fwd_fused_ms": ratio(t_f, 1.0), "fwd_honly_ms": ratio(t_h, 1.0),
           "fwd_cublas_ms": t_mm, "bwd_baseline_ms": t_bb, "bwd_fused_ms": ratio(t_b, 1.0), "bwd_cublas_ms": t_bm}
    if sweep.dead:
        out["cuda_lost"] = sweep.dead
    elif check and fb and hb and bb:
        out.update(_check_gpu(x, w, dy, wd, u_c, swiglu_c, swiglu_backward, FWD_CONFIGS[fb], FWD_CONFIGS[hb],
                              BWD_CONFIGS[bb]))
    out["rows"] = list(ROWS)

    def fmt(r):
        return "n/a (no config passed)" if r is None else f"{r:.3f}"

    out["summary"] = (f"M={M} H={H} F={F}: fwd fused/baseline {fmt(out['fwd_ratio'])} ({fb}), h-only "
                      f"{fmt(out['fwd_honly_ratio'])}; bwd {fmt(out['bwd_ratio'])} ({bb})"
                      + (f"; checks {'ok' if out['checks_ok'] else 'FAILED'}" if "checks_ok" in out else "")
                      + (f"; CUDA context lost at {sweep.dead}" if sweep.dead else ""))
    print(out["summary"], flush=True)
    if not (fb or hb or bb):
        raise RuntimeError(f"no fused config ran and passed its check: {out['summary']}")
    return out


def _check_gpu(x, w, dy, wd, u_c, swiglu_c, swiglu_backward, fcfg, hcfg, bcfg) -> dict:
    """The module docstring's checks on the check rows, with the best configs."""
    rows = _check_rows(x.shape[0]).to(x.device)
    u_f, h_f = fused_forward(x, w, fcfg)
    _, h_only = fused_forward(x, w, hcfg, write_u=False)
    _, h_only_same_cfg = fused_forward(x, w, fcfg, write_u=False)
    ref = x[rows].float() @ w.float().t()
    e_cublas, e_fused = (u_c[rows].float() - ref).abs(), (u_f[rows].float() - ref).abs()
    u_ok = bool(e_fused.max() <= 2 * e_cublas.max() and e_fused.mean() <= 1.25 * e_cublas.mean())
    h_ulps = _ulps(h_f, swiglu_c(u_f))
    h_same = bool(torch.equal(h_f, h_only_same_cfg))
    h_only_ulps = _ulps(h_f, h_only)
    del u_f, h_f, h_only, h_only_same_cfg
    du_f = fused_backward(dy, wd, u_c, bcfg)
    du_b = swiglu_backward(torch.mm(dy, wd), u_c)
    du_ref = _bwd_twin((dy[rows].float() @ wd.float()).bfloat16(), u_c[rows]).float()
    eb, ef = (du_b[rows].float() - du_ref).abs().max().item(), (du_f[rows].float() - du_ref).abs().max().item()
    # du = bf16(dh) * f(u): a dh that rounds to the reference's neighbour moves du by <= 2^-7 relative, plus du's
    # own rounding; the floor (2^-8 of du's rms) covers f(u)'s cancellation near gate = -1.28, where du ~ 0
    floor = 2 ** -8 * du_ref.square().mean().sqrt()
    rel_b, rel_f = (((d[rows].float() - du_ref).abs() / (du_ref.abs() + floor)).max().item() for d in (du_b, du_f))
    du_ok = ef <= 2 * eb + 1e-6 or rel_f <= 2 ** -6
    du_same = (du_f.view(torch.int16) == du_b.view(torch.int16)).float().mean().item()
    res = dict(u_err_max_cublas=e_cublas.max().item(), u_err_max_fused=e_fused.max().item(),
               u_err_mean_cublas=e_cublas.mean().item(), u_err_mean_fused=e_fused.mean().item(), u_ok=u_ok,
               h_ulps_vs_compiled=h_ulps, h_only_bits_equal=h_same, h_only_best_ulps=h_only_ulps,
               du_err_max_baseline=eb, du_err_max_fused=ef, du_rel_max_baseline=rel_b, du_rel_max_fused=rel_f,
               du_ok=du_ok, du_bits_equal_share=round(du_same, 6))
    # h_only_best_ulps is information: another config may sum u in another order (a u ulp can move h by several
    # ulps where silu is steep relative to its value); that config passed the whole-tensor check in the sweep
    res["checks_ok"] = bool(u_ok and h_ulps <= 1 and h_same and du_ok)
    print("checks: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()),
          flush=True)
    return res


def dry_run(params: dict) -> dict:
    raise Skip("times Triton TMA GEMMs against cuBLAS on an sm_90 GPU (the CPU has only Triton's interpreter: "
               "`TRITON_INTERPRET=1 python -m bench.gemm_swiglu` checks the kernels' numbers)")


# ------------------------------------------------------------------------------------------- CPU self-check
def _selfcheck() -> None:
    """Under TRITON_INTERPRET=1: both kernels at a tiny shape (M not a multiple of BM: a partial row tile; several
    tiles per program), for small configs, against fp32-upcast torch references."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        raise SystemExit("run as TRITON_INTERPRET=1 python3 -m bench.gemm_swiglu")
    dev = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    torch.manual_seed(0)
    M, H, F = 200, 128, 192
    x = torch.randn(M, H, device=dev).bfloat16()
    w = (torch.randn(2 * F, H, device=dev) / H ** 0.5).bfloat16()
    dy = torch.randn(M, H, device=dev).bfloat16()
    wd = (torch.randn(H, F, device=dev) / H ** 0.5).bfloat16()
    u_ref = x.float() @ w.float().t()
    dh_ref = dy.float() @ wd.float()
    u_in = u_ref.bfloat16()
    du_ref = _bwd_twin(dh_ref.bfloat16(), u_in)
    ok = True
    # BN divides F = 192; K = 128 is 2-4 k-steps; every epilogue variant (the interpreter ignores ws)
    for cfg in (Cfg(64, 64, 32, 2, 4), Cfg(64, 64, 64, 2, 4, sub=2), Cfg(32, 32, 64, 2, 4, sub=2, ptr=True),
                Cfg(128, 64, 32, 2, 4, ws=True, ptr=True), Cfg(64, 64, 32, 3, 8, sub=2, ptr=True)):
        u, h = fused_forward(x, w, cfg)
        _, h2 = fused_forward(x, w, cfg, write_u=False)
        du = fused_backward(dy, wd, u_in, cfg)
        # u: one rounding of the fp32 sum, in another order than torch's: at most 1 bf16 ulp from the rounded
        # reference (a sum within fp32 noise of a rounding tie goes either way). h: from the kernel's own u, the
        # fp32 formula rounded once: 1 ulp (exp and op order). du = dh * f(u): the kernel's dh may round to the
        # neighbour of the reference's (2^-7 relative at most), so 3 ulps; most elements equal.
        up, gate = u.float().chunk(2, -1)
        h_want = (gate * torch.sigmoid(gate) * up).bfloat16()
        eu, eh, edu = _ulps(u, u_in), _ulps(h, h_want), _ulps(du, du_ref)
        su, sdu = (u == u_in).float().mean().item(), (du == du_ref).float().mean().item()
        same_h = torch.equal(h, h2)
        good = eu <= 1 and su > 0.9 and eh <= 1 and edu <= 3 and sdu > 0.9 and same_h
        ok &= good
        print(f"cfg {cfg}: u {eu} ulp ({su:.1%} equal), h {eh} ulp, du {edu} ulp ({sdu:.1%} equal), h-only == h: "
              f"{same_h} -> {'ok' if good else 'FAIL'}", flush=True)
    print("self-check", "passed" if ok else "FAILED")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    _selfcheck()
