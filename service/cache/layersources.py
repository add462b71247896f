"""What a rehydration hands the engine's thread: the layers it has not put in place, as `LayerSource` objects.

A rehydration (service.cache.rehydrate) hands one to its `LayerGate` and stops; the forward step then pulls each layer
from it just before that layer's attention, on its own thread:

- `LandedRuns`: a layer-by-layer engine's frames left in the landing as runs (`FrameRun`): `work` dequantizes a layer
  of every run into the context, `fill` into a one-layer scratch instead, `attend` attends over the layer's codes
  where a kernel reads every run's kind (`cachestore.codec.attend`). Frames that form no run go whole, once, first.
- `LayerGroups`: frames that did not land: `work` dequantizes a group of layers of every frame into the context.

Each keeps the seconds spent dequantizing (the rehydration's before it, included) and reports them once, when the
last layer is first done.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cachestore.codec import FrameRun, OpenFrame
from cachestore.codec import attend as in_codes
from cachestore.codec.arrays import Array
from service.engines.gate import LayerSource


class _Timed(LayerSource):
    """A source over one context `out` [layers, 2, kv_heads, capacity, head_dim] that reports the seconds spent once."""

    def __init__(self, out: Array, block_tokens: int, on_decoded: Callable[[float], None], seconds: float) -> None:
        self.out, self.block_tokens, self.layers = out, block_tokens, out.shape[0]
        self._on_decoded = on_decoded
        self.seconds = seconds  # spent dequantizing this hit so far, by the rehydration before it handed over
        self._reported = False

    def _timed(self, last_layer: int, seconds: float) -> None:
        self.seconds += seconds
        if last_layer + 1 == self.layers and not self._reported:  # the hit's dequantization, once: the first pass
            self._reported = True
            self._on_decoded(self.seconds)

    def _span(self, index: int) -> slice:
        return slice(index * self.block_tokens, (index + 1) * self.block_tokens)


class LandedRuns(_Timed):
    """Runs of frames in the landing, a layer at a time (and the frames that form no run, whole, before the first)."""

    def __init__(self, out: Array, block_tokens: int, on_decoded: Callable[[float], None], seconds: float,
                 runs: list[tuple[int, FrameRun]], whole: list[tuple[int, OpenFrame]]) -> None:
        super().__init__(out, block_tokens, on_decoded, seconds)
        b = block_tokens
        _, _, self._heads, _, self._dim = out.shape
        self._runs = runs  # (first block, run)
        self._spans = [(first * b, (first + run.count) * b) for first, run in runs]  # the tokens each run holds
        self._whole = list(whole)  # (block, frame): into the context once, by whichever of work and fill comes first
        # the token where what they write ends
        self.fills_until = max([stop for _, stop in self._spans] + [(index + 1) * b for index, _ in whole])
        self.attends = all(in_codes.supports(run.header) for _, run in runs)

    def _whole_into_context(self) -> None:
        for index, frame in self._whole:
            frame.decode_into(self.out[:, :, :, self._span(index)])  # [L, 2, H, b, D] view
        self._whole.clear()

    def _runs_into(self, dest: Array, layer: int) -> None:
        """Layer `layer` of every run into `dest` [2, H, tokens, D] (the whole frames into the context first)."""
        self._whole_into_context()
        heads, b, dim = self._heads, self.block_tokens, self._dim
        for (start, stop), (_, run) in zip(self._spans, self._runs, strict=True):  # [frames, 2, heads, b, dim]
            run.decode_layer_into(dest[:, :, start:stop].view(2, heads, run.count, b, dim).permute(2, 0, 1, 3, 4),
                                  layer)

    def work(self, first: int) -> int:
        """Layer `first` of every run into the context; returns the next layer."""
        t0 = time.perf_counter()
        self._runs_into(self.out[first], first)
        self._timed(first, time.perf_counter() - t0)
        return first + 1

    def fill(self, layer: int, dest: Array) -> bool:
        """The layer's cached tokens into `dest` (the runs from the landing, every other token copied from the
        context), not the context; False for a `dest` shorter than the hit."""
        tokens = dest.shape[2]
        if self._spans[-1][1] > tokens:
            return False  # a cache shorter than the hit: the context's own layer is read
        t0 = time.perf_counter()
        self._runs_into(dest, layer)
        at = 0
        for start, stop in [*self._spans, (tokens, tokens)]:  # tokens no run holds: as the context holds them
            if start > at:
                dest[:, :, at:start] = self.out[layer, :, :, at:start]
            at = stop
        self._timed(layer, time.perf_counter() - t0)
        return True

    def attend(self, layer: int, query: Array, keys: Array, values: Array, mask: Array | None,
               scaling: float) -> Array | None:
        """The layer's attention over the runs' codes and the context's other tokens; writes nothing but the whole
        frames."""
        if not self.attends or self._spans[-1][1] > keys.shape[1] - query.shape[1]:
            return None  # a cache shorter than the hit: the context's own layer is read
        t0 = time.perf_counter()
        self._whole_into_context()
        landed = [in_codes.landed(run.header, run.count, start, run.layer_parts(layer))
                  for (start, _), (_, run) in zip(self._spans, self._runs, strict=True)]
        out = in_codes.attention(query, landed, keys, values, mask, scaling)
        self._timed(layer, time.perf_counter() - t0)
        return out


class LayerGroups(_Timed):
    """Frames (blocks first, first + 1, ...) dequantized `step` layers at a time into the context. Frames whose codes
    do not split by layer go whole with the first group."""

    def __init__(self, out: Array, block_tokens: int, on_decoded: Callable[[float], None], seconds: float,
                 frames: list[OpenFrame], first: int, step: int) -> None:
        super().__init__(out, block_tokens, on_decoded, seconds)
        self._frames, self._first, self._step = frames, first, step

    def work(self, first: int) -> int:
        """Layers [first, first + step) of every frame into the context; returns where the group ends."""
        t0 = time.perf_counter()
        layers, start = self.layers, first
        stop = min(layers, start + self._step)
        group = slice(start, stop)
        for k, frame in enumerate(self._frames):
            span = self._span(self._first + k)
            if stop - start == layers:
                frame.decode_into(self.out[:, :, :, span])  # [L, 2, H, b, D]
            elif frame.splits_by_layer:
                frame.decode_into(self.out[group, :, :, span], group)
            elif start == 0:
                frame.decode_into(self.out[:, :, :, span])
        self._timed(stop - 1, time.perf_counter() - t0)
        return stop
