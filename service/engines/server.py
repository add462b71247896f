"""The sidecar's capability: an engine whose model runs in a server of its own, which the pod lends slots.

Such an engine (`llama-server`, service.engines.llama) generates nothing in the pod: the sidecar (service.sidecar)
passes the server's API through and puts the cache under its completions. Before a request the engine leases a slot
holding what the cache found (`lease`), the server generates into it, and after it the engine saves what the slot
computed (`finish`) or gives it back unknown (`abandon`). The sidecar uses the engine through this class alone.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachestore.codec.arrays import Array
from service.engines.base import Engine
from service.engines.gate import LayerGate


@dataclass(frozen=True)
class SlotLease:
    """Slots held for one request: `slot` (= the first of `slots`) serves it, holding `expected` tokens of
    `prompt`."""

    slot: int
    slots: list[Any]
    prompt: list[int]
    expected: int


class SlotServer(Engine):
    """An engine whose server computes; the pod lends it slots (see the module's docstring)."""

    honours_all_params = False  # the server's own parameters pass through; kvstash checks only the basic ones
    url: str  # the server's base URL
    reuse_slots: bool  # False: every request prefills (a no-cache baseline)
    multimodal: bool  # the server tokenizes its chats itself (images, audio): those pass by the cache
    adapters: list[tuple[int, str]]  # the server's LoRA adapters (id, path): they shape the KV

    @abstractmethod
    def lease(self, prompt_ids: Sequence[int], cached_kv: Array | None, kv_ready: LayerGate | None = None,
              slots: int = 1, boundary: bytes | None = None) -> SlotLease:
        """A slot for a request of `prompt_ids` (and `slots - 1` more for its other choices), holding the prompt's
        first tokens: what the slot kept, or `cached_kv` restored into it."""

    @abstractmethod
    def finish(self, lease: SlotLease, reused: int, keep_from: int = 0, save: bool = True) -> Any:
        """After the request: save the slot and return its tokens and their KV from `keep_from` on (None when it
        could not be saved), and give the slots back."""

    @abstractmethod
    def abandon(self, lease: SlotLease) -> None:
        """Give a lease's slots back when its request failed or was cancelled: what they hold is unknown."""

    @abstractmethod
    def count_bypass(self, why: str) -> None:
        """Count a request sent past the cache, by reason (the sidecar's metrics)."""
