"""--document-masking on the GPU, through the Trainer (its resolution, compiled bf16 blocks, micro-step and gradient
manager): a packed micro-batch's loss and every gradient equal those of its documents run one at a time, with
compiled blocks (flash varlen and the masked fallback), --recompute-block, --recompute-att and --attn-bwd-chunks 2
over 4 rows; with e4m3 block linears they equal those of its documents as the rows of one micro-batch (below);
--use-cuda-graphs is refused with the option and, unset, stays off where it would be on without it, while a
Trainer.step with the position ids gives the documents' mean loss. Marked gpu. The CPU tests (fp32, exact to 1e-5):
tests/model/test_document_masking.py; the kernels': tests/kernels/test_document_attention.py.

Each check is a function of the device, so a CPU run can call it (bf16, compile on: the kernels' twins and the
masked form): that is how the harness was checked without a GPU, the numbers below are from it.

The model: qwen2 (QKV bias, GQA 4:2, head size 64), 2 layers, hidden 256; transformers' random init with the
matrices 3x larger (std 0.06), so that attention is far from uniform: rows without the masks (documents see each
other, positions run on) move every gradient by 38-100% of its norm (CPU, four seeds), where bf16 moves it by ~1%.

Tolerances, bf16. The packed run and the per-document one compute the same sums in other groupings: each weight
gradient is one GEMM over the B*T tokens against a sum of per-document GEMMs; attention is flash's varlen kernel over
the documents against causal SDPA over each one alone (other tiles, other softmax blocking); the compiled blocks keep
fp32 where the eager reference rounds to bf16 between ops. Neither is exact, so both are measured against the exact
answer, the per-document run in fp32 on the CPU from the same bf16 weights (exact to ~1e-6,
tests/model/test_document_masking.py): per tensor, the packed run's error norm relative to the gradient's norm must
be within FACTOR = 2 of the bf16 per-document run's, plus FLOOR = 2e-3 (one bf16 unit roundoff, 2^-9, for tensors
where both are tiny). Measured: the per-document run's errors 5e-3 to 1.6e-2, the packed run's 0.93x to 1.06x of
them; 2x leaves room for the GPU's kernels, and the bound (at most ~3.3e-2) is over 10x below what the rows without
the masks miss by (>= 0.38, 26x the bound): `assert_can_fail` checks CAN_FAIL = 10 in every case. The summed loss:
LOSS_TOL = 3e-4 relative, where bf16 moves it by about u x (logit spread) / sqrt(tokens), measured 1e-6 to 6e-5.
The summed loss is a weak witness of the masks (the tokens' changes have both signs: without the masks it moved by
1.1e-3 to 1.1e-2 over four seeds), so the gradients carry the can-fail check.

e4m3 (per-tensor current scaling): the scales are abs-maxes over the micro-batch, so a document alone is quantized
on other grids than in the packed batch, and the two runs differ by e4m3's rounding (7-16% of the gradients' norm,
measured), too close to the masks' effect to tell apart. The same documents as the rows of one micro-batch (equal
lengths: 4 rows of 4 x 64 tokens are 16 rows of 64) are the same tokens, so the same abs-maxes and scales, and run
through the same compiled blocks (FP8 MLP, one-pass SwiGLU, FP8 head backward: all the Trainer resolves); the rows'
attention is torch's flash kernel (--sdpa-backend flash), the varlen kernel's dense sibling. What differs is a
rounding in attention, and e4m3 amplifies it: a value moved by a bf16 unit crosses an e4m3 rounding boundary with
probability ~2^-8 / 2^-4, and then moves by a whole e4m3 step, at every quantization below it. Measured on the CPU:
0 (the last MLP) to 4.9e-2 of the gradient's norm (the first layer) where the forward is bitwise equal (as flash's
varlen and dense kernels may well be), 0.10 with the varlen twin (fp32 inside) against the rows' bf16 SDPA, the
forward differing too. E4M3_TOL = 0.2 of the norm (2x that), while without the masks every gradient moves by >= 0.56
(checked: >= E4M3_CAN_FAIL = 2.5x the tolerance). The loss: E4M3_LOSS_TOL = 1.5e-3 (measured 0 to 3.4e-4; without
the masks 5.7e-3 off).
"""
from __future__ import annotations

import pytest
import torch

from qtrain.kernels.cross_entropy import IGNORE_INDEX
from qtrain.kernels.document_attention import resolve_document_attention
from qtrain.model.hf_io import save_hf_model
from qtrain.model.llama import LlamaConfig
from qtrain.model.transformer import RunOptions
from qtrain.options import Options, OptionsError
from qtrain.train.trainer import Trainer
from tests.model.test_document_masking import packed_batch, params_of, run_alone, run_packed
from tests.triton_interp import needs_cuda

CFG = LlamaConfig(model_type="qwen2", vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=True, rms_norm_eps=1e-6, bos_token_id=None,
                  eos_token_id=None)
SCALE = 3.0  # the matrices of transformers' init (std 0.02) times this (module docstring)
# 4 rows of 256 tokens (the last document of each row padding): odd lengths, a one-token document, a row of one
ROWS = [(37, 101, 5, 90, 23), (253, 3), (64, 64, 64, 61, 3), (150, 1, 99, 6)]
# e4m3: documents of one length, so that they are also the rows of a (16, 64) micro-batch (module docstring)
EQUAL_ROWS = [(64, 64, 64, 64)] * 4
B, T = len(ROWS), sum(ROWS[0])
FACTOR, FLOOR, LOSS_TOL = 2.0, 2e-3, 3e-4
E4M3_TOL, E4M3_LOSS_TOL, E4M3_CAN_FAIL = 0.2, 1.5e-3, 2.5
CAN_FAIL = 10.0  # without the masks every gradient misses by at least this many times its bound

# name -> Options fields: what runs the packed micro-batch (the Trainer compiles its blocks on CUDA)
CASES = {
    "compiled-varlen": {},  # auto: flash varlen for bf16 on CUDA
    "compiled-masked": {"document_attention": "masked"},  # the fallback: SDPA with a block-diagonal causal mask
    "recompute-block": {"recompute_block": True},
    "recompute-att": {"recompute_att": True},
    "attn-bwd-chunks": {"attn_bwd_chunks": 2},  # two slices of 2 rows, each its own varlen call
}


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> str:
    """CFG's HF checkpoint (bf16): transformers' random init, the matrices SCALE times larger."""
    params = {n: t.detach() * (SCALE if t.dim() == 2 else 1.0) for n, t in params_of(CFG).items()}
    out = tmp_path_factory.mktemp("document-masking-gpu")
    save_hf_model(out, CFG, params, dtype=torch.bfloat16)
    return str(out)


def trainer(weights_dir: str, device: str, **kw) -> Trainer:
    """A one-process Trainer of the checkpoint with --document-masking (B x T micro-batches, no accumulation)."""
    base = dict(model=weights_dir, device=device, model_dtype="bf16", batch_size=B, seq_len=T, grad_accumulation=1,
                document_masking=True, memory_check=False, seed=0)
    return Trainer(Options(**{**base, **kw}))


def micro_step(tr: Trainer, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
               ) -> tuple[float, dict[str, torch.Tensor]]:
    """The summed token loss (loss scale 1) of one Trainer micro-step and the gradients its optimizer would get (fp32
    copies); an update at learning rate 0 closes the step and leaves the weights as they were."""
    tr.micro_step(inputs, targets, positions, loss_scale=1.0)
    grads = {k: g.float().clone() for k, g in tr.layout.views(tr.grads.grad_shards()).items()}
    return tr.update(lr=0.0)["loss"], grads


def leaves(tr: Trainer, dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    """The Trainer's weights as leaf tensors of `dtype` on `device`, for the reference runs."""
    return {n: p.detach().to(device, dtype, copy=True).requires_grad_(True) for n, p in tr.full_params().items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius norms, fp32, on the host)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).norm() / b.norm()).item()


def bounds(alone: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, how far a bf16 run of these documents may be from the exact gradient: FACTOR x the bf16
    per-document run's error + FLOOR (module docstring)."""
    return {k: FACTOR * rel(alone[k], ref) + FLOOR for k, ref in truth.items()}


def assert_within(packed: tuple, truth: tuple, limit: dict[str, float]) -> None:
    (loss, grads), (ref_loss, ref_grads) = packed, truth
    assert abs(float(loss) - float(ref_loss)) <= LOSS_TOL * abs(float(ref_loss)), (float(loss), float(ref_loss))
    assert set(grads) == set(ref_grads)
    worst = {k: rel(grads[k], ref) / limit[k] for k, ref in ref_grads.items()}
    assert max(worst.values()) <= 1.0, {k: f"{v:.2f} of its bound" for k, v in worst.items() if v > 1.0}


def assert_can_fail(plain: tuple, truth: tuple, limit: dict[str, float]) -> None:
    """The same rows without the masks (documents see each other, positions run on): CAN_FAIL x over the bound."""
    miss = min(rel(plain[1][k], ref) / limit[k] for k, ref in truth[1].items())
    assert miss >= CAN_FAIL, f"without the masks a gradient moved only {miss:.1f}x its bound"


def check_documents_alone(weights_dir: str, device: str, **kw) -> Trainer:
    """A packed micro-batch through the Trainer (options `kw`) against its documents run alone (module docstring)."""
    tr = trainer(weights_dir, device, **kw)
    inputs, targets, positions, docs = packed_batch(CFG.vocab_size, seed=3, rows=ROWS)
    exact, bf16 = leaves(tr, torch.float32, "cpu"), leaves(tr, torch.bfloat16, device)
    packed = micro_step(tr, inputs, targets, positions)
    truth = run_alone(CFG, exact, docs)  # fp32 on the CPU: exact to ~1e-6
    limit = bounds(run_alone(CFG, bf16, docs)[1], truth[1])  # eager bf16, one document at a time
    assert_within(packed, truth, limit)
    assert_can_fail(run_packed(CFG, bf16, RunOptions(), inputs.to(device), targets.to(device), None), truth, limit)
    return tr


def check_e4m3_rows(weights_dir: str, device: str, **kw) -> Trainer:
    """e4m3 linears: the packed micro-batch against its documents as the rows of one micro-batch, both through the
    Trainer's blocks (module docstring). The scale hints of the one-pass FP8 SwiGLU (predicted from a layer's last
    call) are put back between the two, so both start from the same."""
    tr = trainer(weights_dir, device, matmul_dtype="e4m3", fp8_policy="all", sdpa_backend="flash", **kw)
    inputs, targets, positions, _ = packed_batch(CFG.vocab_size, seed=4, rows=EQUAL_ROWS)
    n = EQUAL_ROWS[0][0]
    rows_in, rows_t = inputs.reshape(-1, n), targets.reshape(-1, n)
    w, hints = leaves(tr, torch.bfloat16, device), tr.model.scale_hints()
    loss, grads = micro_step(tr, inputs, targets, positions)
    if hints is not None:
        tr.model.load_scale_hints(hints)
    ref_loss, ref = micro_step(tr, rows_in, rows_t)
    assert all(torch.equal(p, w[k]) for k, p in tr.full_params().items())  # both saw the same weights
    assert abs(loss - ref_loss) <= E4M3_LOSS_TOL * abs(ref_loss), (loss, ref_loss)
    errors = {k: rel(grads[k], g) for k, g in ref.items()}
    assert max(errors.values()) <= E4M3_TOL, {k: f"{e:.1e}" for k, e in errors.items() if e > E4M3_TOL}
    # can fail: eager e4m3 over the same tokens (the same scales) without the masks moves every gradient far more
    e4m3 = RunOptions(matmul_dtype="e4m3")
    plain = run_packed(CFG, w, e4m3, inputs.to(device), targets.to(device), None)[1]
    as_rows = run_packed(CFG, w, e4m3, rows_in.to(device), rows_t.to(device), None)[1]
    miss = min(rel(plain[k], g) for k, g in as_rows.items())
    assert miss >= E4M3_CAN_FAIL * E4M3_TOL, f"without the masks a gradient moved only {miss:.2e}"
    return tr


def check_step_loss(tr: Trainer) -> None:
    """Trainer.step with the position ids as the batch's third tensor: the mean token loss of the documents alone."""
    inputs, targets, positions, docs = packed_batch(CFG.vocab_size, seed=5, rows=ROWS)
    total, _ = run_alone(CFG, leaves(tr, torch.float32, "cpu"), docs)
    mean = total.item() / sum(int((y != IGNORE_INDEX).sum()) for _, y in docs)
    loss = tr.step([(inputs, targets, positions)], lr=0.0)["loss"]
    assert abs(loss - mean) <= LOSS_TOL * mean, (loss, mean)


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_packed_documents_equal_documents_alone(weights_dir, case):
    tr = check_documents_alone(weights_dir, "cuda", **CASES[case])
    assert tr.run.compile and tr.graphs is None  # the blocks compiled, as the Trainer runs them on CUDA
    kind = resolve_document_attention(tr.model.run.document_attention, torch.device("cuda"), torch.bfloat16)
    assert kind == ("masked" if case == "compiled-masked" else "varlen")


@pytest.mark.gpu
@needs_cuda
def test_gpu_e4m3_packed_documents_equal_documents_as_rows(weights_dir):
    tr = check_e4m3_rows(weights_dir, "cuda")
    assert tr.run.compile and tr.model.run.matmul_dtype == "e4m3" and tr.model.run.fp8_linears


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graphs_are_refused_and_stay_off(weights_dir):
    """--use-cuda-graphs with --document-masking: refused by the Trainer in one line (the preflight refuses it first:
    tests/train/test_document_masking_options.py); unset, the graphs that this tiny model would run without the
    option (host-bound micro-steps) stay off, and a step with the position ids trains on the documents alone."""
    with pytest.raises(OptionsError, match=r"--use-cuda-graphs does not support --document-masking") as e:
        trainer(weights_dir, "cuda", use_cuda_graphs=True)
    assert "\n" not in str(e.value)
    assert trainer(weights_dir, "cuda", document_masking=False).graphs is not None
    tr = trainer(weights_dir, "cuda")
    assert tr.graphs is None and any("--document-masking" in b for b in tr.run.cuda_graph_blockers)
    check_step_loss(tr)
