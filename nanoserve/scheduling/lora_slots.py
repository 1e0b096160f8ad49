"""Which LoRA adapter is in which of the engine's device slots (`AdapterSlots`), in plain
Python: the adapters live in host memory (`nanoserve.weights.lora_weights.LoraAdapter`), the
device holds at most S of them at once (`nanoserve.model.lora.LoraWeights`), filled on demand.

The scheduler asks for a row's adapter when it admits the row (`acquire`) and gives it back
when the row leaves, finished or preempted (`release`):
- an adapter already in a slot: the row shares it (a count of its running rows);
- else a free slot, else the least recently used slot whose adapter no running row holds:
  the adapter is copied in (queued on the device after every step that read the slot
  before, so none of them sees the new weights);
- else None: every slot serves running rows, and the row waits (its admission stops; rows
  leave and a slot frees, and with no row running every slot is free).

Invariants (`check_integrity`): each adapter in at most one slot, each slot with at most one
adapter; an adapter with running rows is never evicted; the idle list holds exactly the
resident adapters with no running row, least recently used first. The base model (adapter
None) is slot -1 and needs no slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from nanoserve.errors import NanoserveError
from nanoserve.model.config import ModelConfig
from nanoserve.model.lora import LoraWeights
from nanoserve.weights.lora_weights import LoraAdapter, load_adapter, parse_lora_specs

DEFAULT_MAX_LORAS = 8  # device slots, unless the engine is told (at most one per adapter)


class AdapterSlots:
    """The engine's adapters (`adapters`, by name) over its device slots (`weights`)."""

    def __init__(self, adapters: Mapping[str, LoraAdapter], weights: LoraWeights | None
                 ) -> None:
        self.adapters = dict(adapters)
        self.weights = weights
        self.slot_of: dict[str, int] = {}  # resident adapters
        self.rows: dict[str, int] = {}  # running rows per resident adapter
        self.idle: OrderedDict[str, None] = OrderedDict()  # resident, no rows: LRU first
        self.free = list(range(weights.num_slots - 1, -1, -1)) if weights is not None else []
        self.loads = 0  # adapters copied into a slot, over the engine's life

    @classmethod
    def empty(cls) -> AdapterSlots:
        """An engine without adapters: every row runs the base model (slot -1)."""
        return cls({}, None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def check_names(self, lora: Sequence[str | None] | None, n: int) -> list[str | None]:
        """n rows' adapters (None: all the base model); ValueError naming an unknown one."""
        lora = list(lora) if lora is not None else [None] * n
        if len(lora) != n:
            raise ValueError(f"one LoRA adapter (or None) per prompt: {len(lora)} for {n}")
        if bad := [a for a in lora if a is not None and a not in self.adapters]:
            raise ValueError(f"unknown LoRA adapter {bad[0]!r} (the engine's: "
                             f"{', '.join(self.adapters) or 'none'})")
        return lora

    def acquire(self, name: str | None) -> int | None:
        """A slot holding adapter `name` for one more running row (-1 for None: the base
        model), loading it if needed; None when every slot serves running rows."""
        if name is None:
            return -1
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        slot = self.slot_of.get(name)
        if slot is None:
            if self.free:
                slot = self.free.pop()
            elif self.idle:
                victim, _ = self.idle.popitem(last=False)
                slot = self.slot_of.pop(victim)
                del self.rows[victim]
            else:
                return None
            self.weights.load(slot, self.adapters[name].tensors)
            self.loads += 1
            self.slot_of[name], self.rows[name] = slot, 0
        self.idle.pop(name, None)
        self.rows[name] += 1
        return slot

    def release(self, name: str | None) -> None:
        """One running row of adapter `name` left (nothing for None)."""
        if name is None:
            return
        self.rows[name] -= 1
        if self.rows[name] == 0:
            self.idle[name] = None  # the most recently used end

    def check_integrity(self) -> None:
        slots = list(self.slot_of.values())
        assert len(set(slots)) == len(slots) and not set(slots) & set(self.free)
        assert len(slots) + len(self.free) == (self.weights.num_slots if self.weights else 0)
        assert set(self.rows) == set(self.slot_of) and min(self.rows.values(), default=0) >= 0
        assert list(self.idle) == [n for n in self.idle if self.rows[n] == 0]
        assert set(self.idle) == {n for n, k in self.rows.items() if k == 0}


def build_adapter_slots(config: ModelConfig,
                        specs: Mapping[str, str | Path] | Sequence[str] | None,
                        max_loras: int | None, dtype: torch.dtype, device: torch.device
                        ) -> AdapterSlots | None:
    """The engine's adapters read from their PEFT folders (`--lora NAME=PATH` strings or a
    {name: folder} mapping) into host memory, and `max_loras` device slots (default: one per
    adapter, at most `DEFAULT_MAX_LORAS`) at their largest rank over the union of their
    targets. None without adapters. ModelError for a folder that cannot be used."""
    folders = parse_lora_specs(specs)
    if not folders:
        return None
    if max_loras is None:
        max_loras = min(len(folders), DEFAULT_MAX_LORAS)
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise NanoserveError(f"max_loras (adapters on the device at once) must be an int >= 1, "
                             f"got {max_loras!r}")
    pin = device.type == "cuda"
    adapters = {name: load_adapter(name, folder, config, dtype, pin)
                for name, folder in folders.items()}
    targets = {t for a in adapters.values() for t in a.config.targets}
    rank = max(a.config.rank for a in adapters.values())
    return AdapterSlots(adapters, LoraWeights(config, targets, rank, max_loras, dtype, device))


__all__ = ["DEFAULT_MAX_LORAS", "AdapterSlots", "build_adapter_slots"]
