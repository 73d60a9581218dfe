"""`--debug-log-abs-max N`: every N steps, the abs-max of what the FP8 block linears quantize.

For each layer: the four linear inputs (act.ln1 = QKV input, act.att = attention output, act.ln2 = MLP-up
input, act.swiglu = MLP-down input), the four output gradients (grad.qkv, grad.o, grad.up, grad.down) and
the weights. With per-tensor current scaling these abs-maxes *are* the scales (scale = fmax / abs-max), so
a run that diverges in FP8 shows here which tensor's range blew up (llm.q logs the same names).

Recording wraps the block linear: it runs only on debug steps, where the trainer uses the eager block
function (a recording side effect cannot live inside a compiled graph). The linears of a block run in a
fixed order (qkv, o, up, down), so the n-th call of a forward belongs to layer n // 4; calls after the
first 4 L are recomputations in backward. With --recompute-block the forward runs without gradients and
backward replays blocks last to first, so only weights are recorded then.
"""
from __future__ import annotations

from typing import Callable

import torch

ACT_NAMES = ("ln1", "att", "ln2", "swiglu")
GRAD_NAMES = ("qkv", "o", "up", "down")
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class AbsMaxRecorder:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.active = False
        self._calls = 0
        self.values: dict[str, torch.Tensor] = {}

    def start(self) -> None:
        self.active, self._calls, self.values = True, 0, {}

    def stop(self) -> dict[str, float]:
        """End recording; returns name -> abs-max (one host sync, on debug steps only)."""
        self.active = False
        return {k: float(v) for k, v in sorted(self.values.items())}

    def wrap(self, linear: Linear) -> Linear:
        def recording_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *fp8_copy) -> torch.Tensor:
            """fp8_copy: the weight source's (e4m3 weight, inverse scale), passed on to the linear when given."""
            y = linear(x, w, b, *fp8_copy)
            if not self.active or not torch.is_grad_enabled() or self._calls >= 4 * self.num_layers:
                return y  # later calls are recomputations inside backward: the forward values are in
            layer, k = divmod(self._calls, 4)
            self._calls += 1
            act = f"layers.{layer}.act.{ACT_NAMES[k]}"
            self.values[act] = x.detach().abs().amax().float()
            grad = f"layers.{layer}.grad.{GRAD_NAMES[k]}"
            if y.requires_grad:
                y.register_hook(lambda g, name=grad: self._record_grad(name, g))
            return y

        return recording_linear

    def _record_grad(self, name: str, g: torch.Tensor) -> None:
        v = g.detach().abs().amax().float()
        self.values[name] = torch.maximum(self.values[name], v) if name in self.values else v


def weight_abs_maxes(params: dict[str, torch.Tensor]) -> dict[str, float]:
    """Abs-max of every block matrix (the FP8-quantized weights)."""
    out = {}
    for name, p in params.items():
        if name.rsplit(".", 1)[-1] in GRAD_NAMES:
            out[f"{name}.weight"] = float(p.detach().abs().amax())
    return out
