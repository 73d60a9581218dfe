"""Which layer a weight source that streams blocks should fetch next: the model's per-block loop walks the layers up
in the forward (0, 1, ..., L-1) and down in the backward (L-1, ..., 0), asking for the last layer twice where it turns
around, and an evaluation or the next micro-step's forward starts over at 0. Sources that keep only two layers on the
device (sharded weights' gathers, an offloaded e4m3 LoRA base's copies) fetch the one after the asked one in the
pass's direction while the asked one computes."""
from __future__ import annotations


class LayerWalk:
    """The direction of the pass from the layers asked so far, and the layer to fetch next."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._prev: int | None = None  # the last layer asked for, and the pass's direction (+1 up, -1 down)
        self._dir = 1

    def step(self, layer: int) -> int | None:
        """Layer `layer` is asked for: the layer the pass needs after it (None past either end)."""
        prev, d = self._prev, self._dir
        if prev is None:
            d = 1
        elif layer == prev:  # the pass turned around: forward -> backward at the top, or the next forward
            d = -d
        elif layer > prev:
            d = 1
        else:  # going down, unless a new forward-only pass starts over at layer 0
            d = 1 if (layer == 0 and prev == self.num_layers - 1) else -1
        self._prev, self._dir = layer, d
        nxt = layer + d
        return nxt if 0 <= nxt < self.num_layers else None
