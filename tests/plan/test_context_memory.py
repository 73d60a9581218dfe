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


def test_lora_dropout_masks_of_whole_sequences_are_a_workspace_phase():
    """LoRA dropout under --context-parallel: each rank draws the whole sequence's fp32 uniforms and picks its rows
    (model/lora/adapter.py `_drop`), a transient of B x T x in x 4 bytes plus its rows' copy for the widest input
    (down's 18944 at 7B: 11.2 GB at 131072 tokens, more than the LM head's), stated by the adapter and counted once as
    a workspace phase; none without dropout."""
    rows, total = _rows(context_parallel=8, lora_rank=16, lora_alpha=32.0, lora_dropout=0.1)
    plan = plan_memory(CFG, Options(model="Qwen2.5-7B", seq_len=131072, batch_size=1, model_dtype="bf16",
                                    compile="off", context_parallel=8, lora_rank=16, lora_alpha=32.0, lora_dropout=0.1),
                       world=8, gpu_memory=141 * GiB)
    assert plan.phases["lora_dropout"] == 18944 * 4 * (131072 + 16384) == max(plan.phases.values())
    _, no_dropout = _rows(context_parallel=8, lora_rank=16, lora_alpha=32.0)
    assert total > no_dropout


def test_the_dropout_statement_is_what_drop_allocates():
    """The adapter's statement against the tensors `_drop` makes on the CPU (a dispatch mode records each op's output):
    the whole sequence's uniforms and the picked rows are the two largest, together the statement."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from qtrain.model.lora import LoraAdapter
    from qtrain.model.lora.checks import spec_from_options
    from tests.run_utils import CFG as TINY

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.made.append(out.numel() * out.element_size())
            return out

    class Halves:  # a rank of two holding the first and last quarter of each row (load-balanced causal chunks)
        parts = 2

        def positions(self, local_len, device):
            t = 2 * local_len
            q = t // 4
            return torch.cat([torch.arange(q), torch.arange(t - q, t)]).to(device)

    spec = spec_from_options({"lora_rank": 2, "lora_alpha": 4.0, "lora_dropout": 0.2, "lora_targets": "down"}, TINY)
    adapter = LoraAdapter(TINY, spec, seed=1, context=Halves())
    a = torch.zeros(2, TINY.intermediate_size)
    adapter._layer_of = {a.data_ptr(): 0}  # what bind_layers learns: this A is layer 0's
    B, t = 3, 8
    x = torch.randn(B, t, TINY.intermediate_size)
    with Sizes() as sizes:
        adapter._drop(x, a, "down")
    whole, picked = sorted(sizes.made)[-2:][::-1]
    assert whole == B * 2 * t * TINY.intermediate_size * 4 and picked == B * t * TINY.intermediate_size * 4
    assert adapter.context_dropout_bytes(B, 2 * t, 2) == whole + picked
