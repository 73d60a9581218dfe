"""Weight sources: where the model gets its weights (`model.transformer.WeightSource`).

- `ParamWeights` (replicated.py): full parameters on every rank (ZeRO-1/2, one process).
- `CastWeights` (cast.py): a copy in the compute dtype of replicated master weights (fp32 master, bf16 model).
- `QuantizedWeights` (quantized.py): a source plus e4m3 copies of the block matrices made once per step.
- `ShardedWeights` (sharded.py): only this rank's shard; blocks gathered just in time (ZeRO-3).
- `build_weights` (factory.py): picks one of them for a run's settings, allocates and fills it.
"""
from qtrain.parallel.weights.cast import CastWeights
from qtrain.parallel.weights.factory import RankWeights, build_weights
from qtrain.parallel.weights.quantized import QuantizedWeights
from qtrain.parallel.weights.replicated import ParamWeights
from qtrain.parallel.weights.sharded import ShardedWeights

__all__ = ["CastWeights", "ParamWeights", "QuantizedWeights", "RankWeights", "ShardedWeights", "build_weights"]
