"""--context-parallel in the memory plan (plan/context.py): the row of what each mode's attention adds to a rank's
B x T/N tokens, computed on the CPU for Qwen2.5-7B at 131072 tokens over 8 ranks. The all-gather mode keeps every
layer's gathered K/V (28 x 2 x 131072 x 4 x 128 bf16 = 7 GiB) and a (16384, 131072) bool mask (2 GiB), or with
recomputed attention one layer's; the ring keeps nothing more per layer, and its transient is bounded by a block and
slices of query rows (under 2 GiB)."""
from __future__ import annotations

from qtrain.model.registry import preset
from qtrain.options import Options
from qtrain.plan.memory import GiB
from qtrain.plan.resolution import plan_memory

CFG = preset("Qwen2.5-7B")


def _rows(**opts):
    o = Options(model="Qwen2.5-7B", seq_len=131072, batch_size=1, model_dtype="bf16", compile="off", **opts)
    plan = plan_memory(CFG, o, world=8, gpu_memory=141 * GiB)
    return {it.name: it.device for it in plan.items}, plan.device_total


def test_each_mode_states_what_its_attention_adds():
    (gather, gather_total), (ring, ring_total) = (_rows(context_parallel=8, context_parallel_mode=m)
                                                  for m in ("allgather", "ring"))
    kv = 28 * 2 * 131072 * 4 * 128 * 2
    assert gather["context parallel attention (allgather)"] == kv + 16384 * 131072
    assert ring["context parallel attention (ring)"] < 2 * GiB
    assert gather_total - ring_total > 7 * GiB
    plain, _ = _rows()
    assert not any(name.startswith("context parallel") for name in plain)


def test_documents_under_context_parallel_are_its_rows():
    """--document-masking's own row (plan/documents.py: a (B, 1, T, T) mask) is not what a split sequence holds; its
    mask is this rank's (B, 1, T/N, T) one, in the context parallel row, with the rows' document indices."""
    rows, _ = _rows(context_parallel=8, document_masking=True)
    assert "document masks" not in rows
    assert rows["context parallel attention (allgather)"] == 28 * 2 * 131072 * 4 * 128 * 2 + 16384 * 131072 + 8 * 131072
    assert "document masks" in _rows(document_masking=True)[0]


def test_recomputed_attention_keeps_one_layers_gathered_kv():
    """--recompute-att / --recompute-block rerun the attention's forward, the gather included, in each layer's backward:
    the gathered K/V of one layer are live at a time, not of all 28."""
    kv_layer = 2 * 131072 * 4 * 128 * 2
    for flag in ("recompute_att", "recompute_block"):
        rows, _ = _rows(context_parallel=8, **{flag: True})
        assert rows["context parallel attention (allgather)"] == kv_layer + 16384 * 131072, flag
