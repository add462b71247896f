"""Rehydrating fetched blocks into one context, off the event loop, overlapped with the wire.

The lookup feeds each chunk of frames to a `Rehydration` as it arrives. On its own thread (one core) it
verifies every frame at once (header, shape, checksum, decompression: `Codec.open`) and dequantizes whole
frames while the next chunk is still on the wire. When the last chunk is in, the count of good frames is
published: the hit is known and generation can start. The frames not dequantized by then are handed to
the `LayerGate`: an engine that runs layer by layer (transformers) dequantizes each layer group itself,
on its own cores, when its forward step reaches it; any other engine gets them dequantized here first.

Measured on 2 cores with Redis on the same machine (BENCHMARKS.md, section 1): a second thread
dequantizing beside the forward step slowed the forward step by about what it saved (both are memory
bound), and layer groups smaller than the whole context only added calls; so the forward step's
thread dequantizes the rest in one group (LAYER_STEPS = 1) before its first layer.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from cachestore.codec import OpenFrame
from cachestore.errors import CodecError

GATE_TIMEOUT_S = 60.0  # dequantization is CPU work that always ends; this only turns a bug into an error
LAYER_STEPS = 1  # groups the handed-over layers are dequantized in (more: each starts earlier, costs more calls)


class LayerGate:
    """How many leading layers of a context are in place; consumers block until theirs is."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._ready = 0
        self._error: BaseException | None = None
        self._work: Callable[[int], int] | None = None
        self._cond = threading.Condition()

    def release(self, layers_done: int) -> None:
        with self._cond:
            self._ready = max(self._ready, min(layers_done, self.layers))
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def hand_over(self, work: Callable[[int], int]) -> None:
        """The producer stops here: `work(first)` puts the layer group starting at `first` in place and returns
        where the group ends; whoever waits for a layer not in place yet runs it, on its own thread."""
        with self._cond:
            self._work = work
            self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """Return once layer `layer` is in place (doing the handed-over work up to it, if any); raises if the
        rehydration failed."""
        if self._ready > layer:
            return
        with self._cond:  # one consumer at a time runs handed-over work
            while self._ready <= layer:
                if self._error is not None:
                    raise RuntimeError("the cached context could not be rehydrated") from self._error
                if self._work is not None:
                    try:
                        self._ready = self._work(self._ready)
                    except Exception as exc:
                        self._error = exc  # every later waiter fails too
                        raise RuntimeError("the cached context could not be rehydrated") from exc
                    continue
                if not self._cond.wait(GATE_TIMEOUT_S):
                    raise RuntimeError(f"layer {layer} of the cached context was not ready in {GATE_TIMEOUT_S} s")

    def wait_all(self) -> None:
        self.wait(self.layers - 1)


class Rehydration:
    """One lookup's frames -> out[..., block i tokens, :]; fed from the event loop, run on one thread."""

    def __init__(
        self,
        out: torch.Tensor,  # [layers, 2, kv_heads, capacity, head_dim]
        block_tokens: int,
        open_block: Callable[[bytes, int], OpenFrame | None],
        layerwise: bool,
        on_decoded: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.out, self.block_tokens, self.layerwise = out, block_tokens, layerwise
        self._open_block = open_block  # None for a frame to reject (it truncates the hit there)
        self._on_decoded = on_decoded  # the seconds spent dequantizing, once every layer is in place
        self._queue: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        self.gate = LayerGate(out.shape[0])
        self.stopped = threading.Event()  # set at the first bad frame: later chunks are not needed
        self.decode_seconds = 0.0

    def feed(self, frames: Sequence[bytes]) -> None:
        self._queue.put(list(frames))

    def end(self) -> None:
        self._queue.put(None)

    def run(self, on_verified: Callable[[int, int], None]) -> None:
        """Until `end`: verify each chunk as it comes and dequantize whole frames while the queue is empty.
        Then `on_verified(good frames, their bytes)`, and the rest layer group by layer group."""
        try:
            self._run(on_verified)
        except BaseException as exc:  # whoever waits on the gate hears of it: never left waiting
            self.gate.fail(exc)
            raise

    def _run(self, on_verified: Callable[[int, int], None]) -> None:
        opened: list[OpenFrame] = []
        sizes: list[int] = []
        done = 0
        try:
            while (item := self._queue.get()) is not None:
                for frame in item:
                    if self.stopped.is_set():
                        break
                    block = self._open_block(frame, len(opened))
                    if block is None:
                        self.stopped.set()
                        break
                    opened.append(block)
                    sizes.append(len(frame))
                while done < len(opened) and self._queue.empty():
                    if not self._whole(opened[done], done):
                        del opened[done:], sizes[done:]
                        self.stopped.set()
                        break
                    done += 1
        finally:
            on_verified(len(opened), sum(sizes))
        layers = self.gate.layers
        if done == len(opened):
            self.gate.release(layers)
            self._on_decoded(self.decode_seconds)
        elif self.layerwise:  # the forward step dequantizes each layer group when it reaches it, on its own cores
            self.gate.hand_over(self._groups(opened[done:], done, max(1, -(-layers // LAYER_STEPS))))
        else:
            self._groups(opened[done:], done, layers)(0)
            self.gate.release(layers)

    def _span(self, index: int) -> slice:
        return slice(index * self.block_tokens, (index + 1) * self.block_tokens)

    def _whole(self, block: OpenFrame, index: int) -> bool:
        t0 = time.perf_counter()
        try:
            block.decode_into(self.out[:, :, :, self._span(index)])  # [L, 2, H, b, D] view
        except CodecError:
            return False
        finally:
            self.decode_seconds += time.perf_counter() - t0
        return True

    def _groups(self, frames: list[OpenFrame], first: int, step: int) -> Callable[[int], int]:
        """`work(start)`: layers [start, start + step) of `frames` (blocks first, first + 1, ...) into the context,
        on the calling thread; returns where the group ends. Frames whose codes do not split by layer go whole
        with the first group."""
        layers = self.gate.layers

        def work(start: int) -> int:
            t0 = time.perf_counter()
            stop = min(layers, start + step)
            group = slice(start, stop)
            for k, frame in enumerate(frames):
                if stop - start == layers:
                    frame.decode_into(self.out[:, :, :, self._span(first + k)])  # [L, 2, H, b, D]
                elif frame.splits_by_layer:
                    frame.decode_into(self.out[group, :, :, self._span(first + k)], group)
                elif start == 0:
                    frame.decode_into(self.out[:, :, :, self._span(first + k)])
            self.decode_seconds += time.perf_counter() - t0
            if stop == layers:  # the last group, on whichever thread ran it
                self._on_decoded(self.decode_seconds)
            return stop

        return work
