"""SwiGLU's one home: out = up * silu(gate) of the fused up/gate projection's output u = [up | gate], in the model
dtype and, inside the MLP, straight to FP8.

The entries the blocks call:
* `swiglu(u, mode)`: the activation; mode "autograd" (eager) or "kernel" (compiled: the backward as one kernel);
* `fp8_swiglu_mlp(x, w_up, w_down, ...)`: up -> SwiGLU -> down as one FP8 function (compiled e4m3 blocks), the
  SwiGLU output made in FP8 in two passes or, given the layer's scale hints, in one;
* `ScaleHints`: those hints, the op's run state (the Transformer holds one, checkpoints save it).

Modules: activation (forward, backward kernel and twin, autograd, what it saves), fp8 (two-pass forward to FP8),
fp8_onepass (one-pass forward and backward to FP8, power-of-two scales), hints (their state), mlp (the FP8 MLP).
"""
from qtrain.kernels.swiglu.activation import swiglu
from qtrain.kernels.swiglu.hints import ScaleHints
from qtrain.kernels.swiglu.mlp import fp8_swiglu_mlp

__all__ = ["ScaleHints", "fp8_swiglu_mlp", "swiglu"]
