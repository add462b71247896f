"""The gate between a rehydration and the engine reading its context: how many leading layers are in place.

A lookup hands the engine a `LayerGate` with the cached KV: an engine that runs layer by layer waits on it per layer
(and may have a layer filled or attended over its landed codes instead), any other engine for all of them. The
producer (service.cache.rehydrate) releases layers as they land, or hands its remaining work over to whoever waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from cachestore.codec.arrays import Array

T = TypeVar("T")
GATE_TIMEOUT_S = 60.0  # dequantization is CPU work that always ends; this only turns a bug into an error

class LayerGate:
    """How many leading layers of a context are in place; consumers block until theirs is."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._ready = 0
        self._error: BaseException | None = None
        self._work: Callable[[int], int] | None = None
        self._fill: Callable[[int, Array], bool] | None = None
        self._attend: Callable[..., Array | None] | None = None
        self.fills_until = 0  # with `fill`: the context may lack tokens below this until each layer is waited for
        self._cond = threading.Condition()

    def release(self, layers_done: int) -> None:
        with self._cond:
            self._ready = max(self._ready, min(layers_done, self.layers))
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def hand_over(self, work: Callable[[int], int], fill: Callable[[int, Array], bool] | None = None,
                  until: int = 0, attend: Callable[..., Array | None] | None = None) -> None:
        """The producer stops here: `work(first)` puts the layer group starting at `first` in place and returns
        where the group ends; whoever waits for a layer not in place yet runs it, on its own thread. `fill(layer,
        dest)`, where given, puts one layer's cached tokens in `dest` instead of the context (False: it cannot);
        `work` writes no token from `until` on (the rest of the context is in place already). `attend(layer, query,
        keys, values, mask, scaling)`, where given, is `cachestore.attend.attention` over the layer's landed
        codes, the context's `keys` and `values` read only outside them."""
        with self._cond:
            self._work, self._fill, self._attend = work, fill, attend
            self.fills_until = until if fill is not None else 0
            self._cond.notify_all()

    def fill(self, layer: int, dest: Array) -> bool:
        """Put layer `layer`'s cached tokens in `dest` [2, kv_heads, tokens, head_dim] and leave the context's own
        layer as it is (a later `wait` still puts it in place). False when the layer is in place already, or the
        handed-over work cannot fill: then the caller reads the context after `wait`. Raises if the rehydration
        failed."""
        if self._ready > layer:
            return False
        with self._cond:
            if not self._handed(layer) or self._fill is None:
                return False
            return self._call(self._fill, layer, dest)

    def attending(self, layer: int) -> bool:
        """Whether `attend` can serve layer `layer`'s attention from the landed codes (the layer is not in place,
        and the handed-over work attends); raises if the rehydration failed."""
        if self._ready > layer:
            return False
        with self._cond:
            return self._handed(layer) and self._attend is not None

    def attend(self, layer: int, *args: object) -> Array | None:
        """Layer `layer`'s attention over its landed codes (`hand_over`'s `attend`), the context left as it is;
        None where it cannot (then `wait`, and attend over the context). Raises if the rehydration failed."""
        if self._ready > layer:
            return None
        with self._cond:
            if not self._handed(layer) or self._attend is None:
                return None
            return self._call(self._attend, layer, *args)

    def wait(self, layer: int) -> None:
        """Return once layer `layer` is in place (doing the handed-over work up to it, if any); raises if the
        rehydration failed."""
        if self._ready > layer:
            return
        with self._cond:  # one consumer at a time runs handed-over work
            while self._handed(layer):
                assert self._work is not None  # as _handed found it
                self._ready = self._call(self._work, self._ready)

    def _handed(self, layer: int) -> bool:
        """(The lock held.) Block until layer `layer` is in place (False) or work is handed over to put it there
        (True); raises if the rehydration failed, or after GATE_TIMEOUT_S of neither."""
        while True:
            if self._error is not None:
                raise RuntimeError("the cached context could not be rehydrated") from self._error
            if self._ready > layer:
                return False
            if self._work is not None:
                return True
            if not self._cond.wait(GATE_TIMEOUT_S):
                raise RuntimeError(f"layer {layer} of the cached context was not ready in {GATE_TIMEOUT_S} s")

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        """(The lock held.) Handed-over work, on the caller's thread; its failure fails every later waiter too."""
        try:
            return fn(*args)
        except Exception as exc:
            self._error = exc
            raise RuntimeError("the cached context could not be rehydrated") from exc

    def wait_all(self) -> None:
        self.wait(self.layers - 1)
