"""Bad input for LoRA on an MoE model's experts (model/lora/checks.py, peft_io.py): each row gives `qtrain train` one
broken setting or adapter and asserts the bad-input contract (tests/reliability/test_bad_inputs.py's `run_case`):
exit code 2, one line `qtrain: error: ...` naming the option or file, no traceback, nothing under the root changed
(the refusal comes before the model is built).

The MoE model (tests/reliability/test_lora_inputs.moe_model): qwen3_moe, hidden 32, 8 experts of intermediate size
24 (gate and up 24 x 32, down 32 x 24 per expert), layer 1 dense. The dense model is the tiny llama (run_utils.CFG).

Before this change the experts were no target: `--lora-targets q,up` on the MoE model was refused as "an MoE model's
MLP matrix", and an adapter with target_parameters was read as if it had none.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qtrain.model.lora import LoraSpec
from qtrain.model.lora.peft_io import save_adapter
from qtrain.model.lora.tensors import adapter_specs
from qtrain.model.registry import config_from_hf_dict
from tests.reliability.test_bad_inputs import Case, run_case
from tests.reliability.test_lora_inputs import lora, moe_model
from tests.run_utils import make_run_root


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_run_root(tmp_path_factory.mktemp("moe_lora_inputs"))


def moe_adapter(rel: str, targets: tuple[str, ...], config: dict | None = None):
    """A setup writing the MoE model and a PEFT adapter of it (qtrain's writer, rank 4, random tensors) at root/rel,
    its adapter_config.json then updated with `config`."""
    def setup(root: Path) -> None:
        moe_model(root)
        cfg = config_from_hf_dict(json.loads((root / "moe" / "config.json").read_text()))
        spec = LoraSpec(4, 8.0, targets=targets)
        save_adapter(root / rel, cfg, spec, {n: torch.randn(s.shape) for n, s in adapter_specs(cfg, spec).items()},
                     base="tiny", dtype=torch.float32)
        (root / rel / "qtrain-export.json").unlink()
        c = json.loads((root / rel / "adapter_config.json").read_text())
        c.update(config or {})
        (root / rel / "adapter_config.json").write_text(json.dumps(c))
    return setup


MOE = "{root}/moe"
CASES = [
    Case("experts-on-dense-model", lora("--lora-targets", "q,experts"),
         r"--lora-targets: target 'experts' is an MoE model's experts \(this model has no routed layer to adapt\)"),
    Case("up-without-gate", lora("--lora-targets", "q,up", model=MOE),
         r"--lora-targets: up without gate: an MoE model's experts hold gate and up as one matrix", setup=moe_model),
    Case("gate-up-name", lora("--lora-targets", "gate_up_proj", model=MOE),
         r"--lora-targets: target 'gate_up' is not a target name: the experts' projections are gate, up",
         setup=moe_model),
    Case("rank-over-expert-dims", lora("--lora-targets", "gate,up", "--lora-rank", "25", model=MOE),
         r"--lora-rank 25 is larger than the experts' gate/up dimensions \(24 x 32 per expert\); choose a rank <= 24",
         setup=moe_model),
    Case("rank-over-expert-down", lora("--lora-targets", "down", "--lora-rank", "25", model=MOE),
         r"--lora-rank 25 is larger than the experts' down dimensions \(32 x 24 per expert\)", setup=moe_model),
    Case("init-from-other-expert-targets", lora("--lora-targets", "q,gate,up,down", "--lora-init-from", "{root}/a",
                                                model=MOE),
         r"adapter_config\.json: target_parameters \['mlp\.experts\.down_proj'\] differ from this run's "
         r"--lora-targets \(mlp\.experts\.gate_up_proj, mlp\.experts\.down_proj\)",
         setup=moe_adapter("a", ("q", "down"))),
    Case("init-from-gate-up-at-plain-rank", lora("--lora-init-from", "{root}/a", model=MOE),
         r"adapter_config\.json: rank_pattern=\{\} is not supported .*gate_up_proj at twice r and lora_alpha",
         setup=moe_adapter("a", ("q", "gate", "up", "down"), {"rank_pattern": {}, "alpha_pattern": {}})),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_moe_lora_input(case: Case, base: Path, tmp_path: Path, capsys) -> None:
    run_case(case, base, tmp_path, capsys)
