"""The gate between a rehydration and the engine reading its context: how many leading layers are in place.

A lookup hands the engine a `LayerGate` with the cached KV: an engine that runs layer by layer waits on it per layer
(and may have a layer filled or attended over its landed codes instead), any other engine for all of them. The
producer (service.cache.rehydrate) releases layers as they land, or hands what is left over as a `LayerSource`, an
object the waiting thread pulls layers from (service.cache.layersources): no callables cross the threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from cachestore.codec.arrays import Array

T = TypeVar("T")
GATE_TIMEOUT_S = 60.0  # dequantization is CPU work that always ends; this only turns a bug into an error


class LayerSource:
    """The layers of a context a rehydration has not put in place, pulled by the engine's thread as it reaches them.

    A rehydration hands one to its `LayerGate` (`hand_over`) and stops there; from then on only threads waiting at the
    gate call it, one at a time under the gate's lock. `work` is what every source does; `fill` and `attend` are
    optional capabilities whose defaults say "cannot" (the caller then waits, and reads the context)."""

    fills_until = 0  # with `fill`: the context may lack tokens below this until each layer is waited for
    attends = False  # whether `attend` serves a layer's attention from its landed codes

    def work(self, first: int) -> int:
        """Put the layer group starting at `first` in place in the context; returns where the group ends."""
        raise NotImplementedError

    def fill(self, layer: int, dest: Array) -> bool:
        """Put layer `layer`'s cached tokens in `dest` [2, kv_heads, tokens, head_dim], not in the context; False
        when it cannot. Writes no context token from `fills_until` on."""
        return False

    def attend(self, layer: int, query: Array, keys: Array, values: Array, mask: Array | None,
               scaling: float) -> Array | None:
        """Layer `layer`'s attention over its landed codes (`cachestore.codec.attend`), the context's `keys` and
        `values` read only outside them; None where it cannot."""
        return None


class LayerGate:
    """How many leading layers of a context are in place; consumers block until theirs is."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._ready = 0
        self._error: BaseException | None = None
        self._source: LayerSource | None = None  # what the producer handed over: pulled by whoever waits
        self.fills_until = 0  # the source's: the context may lack tokens below this until each layer is waited for
        self._cond = threading.Condition()

    def release(self, layers_done: int) -> None:
        with self._cond:
            self._ready = max(self._ready, min(layers_done, self.layers))
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def hand_over(self, source: LayerSource) -> None:
        """The producer stops here: whoever waits for a layer not in place yet has `source` put it there
        (`LayerSource.work`), on its own thread; `fill` and `attend` serve a layer without putting it in place, where
        the source can."""
        with self._cond:
            self._source = source
            self.fills_until = source.fills_until
            self._cond.notify_all()

    def fill(self, layer: int, dest: Array) -> bool:
        """Put layer `layer`'s cached tokens in `dest` [2, kv_heads, tokens, head_dim] and leave the context's own
        layer as it is (a later `wait` still puts it in place). False when the layer is in place already, or the
        handed-over source cannot fill: then the caller reads the context after `wait`. Raises if the rehydration
        failed."""
        if self._ready > layer:
            return False
        with self._cond:
            source = self._handed(layer)
            return source is not None and self._call(source.fill, layer, dest)

    def attending(self, layer: int) -> bool:
        """Whether `attend` can serve layer `layer`'s attention from the landed codes (the layer is not in place,
        and the handed-over source attends); raises if the rehydration failed."""
        if self._ready > layer:
            return False
        with self._cond:
            source = self._handed(layer)
            return source is not None and source.attends

    def attend(self, layer: int, query: Array, keys: Array, values: Array, mask: Array | None,
               scaling: float) -> Array | None:
        """Layer `layer`'s attention over its landed codes (`LayerSource.attend`), the context left as it is;
        None where it cannot (then `wait`, and attend over the context). Raises if the rehydration failed."""
        if self._ready > layer:
            return None
        with self._cond:
            source = self._handed(layer)
            if source is None or not source.attends:
                return None
            return self._call(source.attend, layer, query, keys, values, mask, scaling)

    def wait(self, layer: int) -> None:
        """Return once layer `layer` is in place (pulling it from the handed-over source, if any); raises if the
        rehydration failed."""
        if self._ready > layer:
            return
        with self._cond:  # one consumer at a time pulls from the source
            while (source := self._handed(layer)) is not None:
                self._ready = self._call(source.work, self._ready)

    def _handed(self, layer: int) -> LayerSource | None:
        """(The lock held.) Block until layer `layer` is in place (None) or a source is handed over to put it there
        (the source); raises if the rehydration failed, or after GATE_TIMEOUT_S of neither."""
        while True:
            if self._error is not None:
                raise RuntimeError("the cached context could not be rehydrated") from self._error
            if self._ready > layer:
                return None
            if self._source is not None:
                return self._source
            if not self._cond.wait(GATE_TIMEOUT_S):
                raise RuntimeError(f"layer {layer} of the cached context was not ready in {GATE_TIMEOUT_S} s")

    def _call(self, method: Callable[..., T], *args: object) -> T:
        """(The lock held.) A method of the handed-over source, on the caller's thread; its failure fails every later
        waiter too."""
        try:
            return method(*args)
        except Exception as exc:
            self._error = exc
            raise RuntimeError("the cached context could not be rehydrated") from exc

    def wait_all(self) -> None:
        self.wait(self.layers - 1)
