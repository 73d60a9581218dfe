"""A LoRA run's outputs: the PEFT adapter (adapter_config.json + adapter_model.safetensors, with the tokenizer files
an export carries), or with --lora-merge the merged model as a plain HF export. Both go through the export's
machinery (`hf_io.write_export`): staged files, a manifest, never over a file no qtrain export wrote.

`qtrain export --lora-merge` merges a checkpoint's adapters into the run's base, which the checkpoint does not hold:
`base_params` makes it again as the run made it (its --model's weights, or the from-scratch init of its seed), in
the run's --model-dtype (the dtype the run held it in), so the merge equals the run's own --lora-merge."""
from __future__ import annotations

import torch

from qtrain.data.hf_tokenizer import export_files
from qtrain.model.config import ModelConfig
from qtrain.model.hf_io import load_hf_weights, save_hf_model
from qtrain.model.init import init_params
from qtrain.model.lora.merge import merged_params
from qtrain.model.lora.peft_io import save_adapter
from qtrain.model.lora.spec import LoraSpec
from qtrain.model.lora.tensors import adapter_specs
from qtrain.model.weights import param_shapes


def export_lora(out_dir: str, cfg: ModelConfig, spec: LoraSpec, params: dict[str, torch.Tensor], *, merge: bool,
                base: str, dtype: torch.dtype, tokenizer: str | None, owner: dict | None = None) -> None:
    """Write the adapters of `params` (the base's and the adapters' by internal name) as a PEFT adapter for `base`,
    or the merged model (`merge`)."""
    extra = export_files(tokenizer, cfg)
    if merge:
        save_hf_model(out_dir, cfg, merged_params(cfg, spec, params, dtype=dtype, device="cpu"), dtype=dtype,
                      extra_files=extra, owner=owner)
        return
    adapters = {n: params[n] for n in adapter_specs(cfg, spec)}
    save_adapter(out_dir, cfg, spec, adapters, base=base, dtype=dtype, owner=owner, extra_files=extra)


def base_params(cfg: ModelConfig, weights_dir: str | None, *, dtype: torch.dtype, seed: int,
                init_proj_to_zero: bool = False) -> dict[str, torch.Tensor]:
    """The frozen base of a LoRA run on the host (module docstring): `weights_dir`'s weights, or (None) the
    from-scratch init of `seed`, in `dtype`."""
    if weights_dir is not None:
        return load_hf_weights(weights_dir, cfg, dtype=dtype, device="cpu")
    params = {n: torch.empty(s, dtype=dtype) for n, s in param_shapes(cfg).items()}
    init_params(cfg, params, seed=seed, init_proj_to_zero=init_proj_to_zero)
    return params
