"""A LoRA run's outputs: the PEFT adapter (adapter_config.json + adapter_model.safetensors, with the tokenizer files
an export carries), or with --lora-merge the merged model as a plain HF export. Both go through the export's
machinery (`hf_io.write_export`): staged files, a manifest, never over a file no qtrain export wrote."""
from __future__ import annotations

import torch

from qtrain.data.hf_tokenizer import export_files
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import save_hf_model
from qtrain.model.lora.merge import merged_params
from qtrain.model.lora.peft_io import save_adapter
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import adapter_specs


def export_lora(out_dir: str, cfg: ModelConfig, spec: LoraSpec, params: dict[str, torch.Tensor], *, merge: bool,
                base: str, dtype: torch.dtype, tokenizer: str | None, owner: dict | None = None) -> None:
    """Write the adapters of `params` (the base's and the adapters' by internal name) as a PEFT adapter for `base`,
    or the merged model (`merge`)."""
    extra = export_files(tokenizer, cfg)
    if merge:
        save_hf_model(out_dir, cfg, merged_params(cfg, spec, params), dtype=dtype, extra_files=extra, owner=owner)
        return
    adapters = {n: params[n] for n in adapter_specs(cfg, spec)}
    save_adapter(out_dir, cfg, spec, adapters, base=base, dtype=dtype, owner=owner, extra_files=extra)
