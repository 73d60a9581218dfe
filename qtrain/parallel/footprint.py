"""What an allocator holds, stated without allocating: bytes by named part, and which parts live in host memory.

Every allocator in `parallel/` (gradient managers, `ShardedAdamW`, the weight sources, the staging ring) has a
function beside its constructor that returns its `Footprint` from the layout and its settings; the instance's
`memory()` / `host_memory_keys()` are that function applied to the instance's own settings, and the memory plan
(`plan/memory.py`) adds the same functions up for options it has not built. tests/plan/test_components.py
checks each statement against the storages a real component holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Footprint:
    """Bytes of persistent buffers by part (e.g. 'block_shards'); `host_keys` names the parts in host memory."""
    parts: dict[str, int]
    host_keys: frozenset[str] = field(default_factory=frozenset)

    @property
    def device(self) -> int:
        return sum(v for k, v in self.parts.items() if k not in self.host_keys)

    @property
    def host(self) -> int:
        return sum(v for k, v in self.parts.items() if k in self.host_keys)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def select(self, *keys: str) -> "Footprint":
        """The parts named `keys` (those present), with their placement."""
        return Footprint({k: self.parts[k] for k in keys if k in self.parts}, self.host_keys & set(keys))

