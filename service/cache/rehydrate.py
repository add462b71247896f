"""Rehydrating fetched blocks into one context, off the event loop, overlapped with the wire.

Two ways, by engine:

- An engine that runs layer by layer (transformers) gets its frames received into one buffer, the lookup's
  landing (`cachestore.wire`), and the lookup's reader only verifies each chunk (`Rehydration.take`: header,
  shape, checksum) between reads. When the last chunk is verified the hit is known, and the frames are handed to
  the `LayerGate` as a `LandedRuns` source (service.cache.layersources) of runs (`FrameRun`): the forward step pulls
  one layer of every block, dequantized in one call, just before that layer's attention, which then reads the layer
  while it is still in the caches. The first step's attention reads each layer's runs in their codes where a kernel
  can (`LayerGate.attend`, `cachestore.codec.attend`; up to a few new tokens), else has them dequantized into a
  one-layer scratch (`LayerGate.fill`); the context is
  written only at the second step: writing a context larger than the caches cost more than the floor's whole read
  of it. A frame that did not land (compressed, or of another length) is
  dequantized whole before layer 0.
- Any other engine (llama.cpp sets its whole state at once): the frames land likewise (one copy on the wire), and
  the lookup feeds each chunk to a `Rehydration` thread (one core), which verifies each chunk and dequantizes its
  frames while the next chunk is on the wire, a few landed frames of one kind in one call (`FrameRun`), and
  dequantizes what is left once the last one is in, shared with a second thread where it is given one (`helper`):
  by then the reader and Redis are done and a core is free. A frame at a time cost about as much Python per frame
  as kernel time, on the two cores the fetch already keeps busy.

Measured on 2 cores with Redis on the same machine: every millisecond of
CPU a hit adds costs about a millisecond of TTFT. Dequantizing frame by frame during the fetch slowed the fetch
(both cores were already busy with redis-server and the reader) and wrote a context larger than the caches that
the forward step then read back from memory; a layer of every block at a time from the landing costs the forward
step about half as much. Without a landing, layer groups smaller than the whole context only
added calls (one per frame per group), so that path dequantizes the rest in one group (LAYER_STEPS = 1).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Executor

from cachestore.codec import FrameRun, OpenFrame
from cachestore.codec.arrays import Array, numel, ptr
from cachestore.errors import CodecError
from cachestore.wire import Target
from service.cache.layersources import LandedRuns, LayerGroups
from service.engines.gate import LayerGate

LAYER_STEPS = 1  # groups the handed-over layers are dequantized in (more: each starts earlier, costs more calls)
RUN_FRAMES = 4  # landed frames dequantized in one call by an engine that takes its state whole (a chunk is 8)


class Rehydration:
    """One lookup's frames -> out[..., block i tokens, :]; fed from the event loop, run on one thread."""

    def __init__(
        self,
        out: Array,  # [layers, 2, kv_heads, capacity, head_dim]
        block_tokens: int,
        open_block: Callable[[bytes | Target, int], OpenFrame | None],
        layerwise: bool,
        on_decoded: Callable[[float], None] = lambda seconds: None,
        landing: Array | None = None,  # 1-D uint8: the buffer the lookup's frames were received into
        helper: Executor | None = None,  # where a second thread shares what is left once the last chunk is in
    ) -> None:
        self.out, self.block_tokens, self.layerwise = out, block_tokens, layerwise
        self.landing = landing if layerwise else None  # a layer-by-layer engine leaves its frames there, by layer
        self._runs_from = landing if not layerwise else None  # any other dequantizes runs of frames from it
        self._helper = helper
        self._open_block = open_block  # None for a frame to reject (it truncates the hit there)
        self._on_decoded = on_decoded  # the seconds spent dequantizing, once every layer is in place
        self._queue: queue.SimpleQueue[list[bytes | Target] | None] = queue.SimpleQueue()
        self.gate = LayerGate(out.shape[0])
        self.stopped = threading.Event()  # set at the first bad frame: later chunks are not needed
        self._opened: list[OpenFrame] = []
        self._sizes: list[int] = []
        self._landed: list[int] = []  # frames read in place from the landing: left for the forward step, by layer
        self._done = 0  # frames before this one are dequantized, or in `_landed`
        self.decode_seconds = 0.0

    def feed(self, frames: Sequence[bytes | Target]) -> None:
        self._queue.put(list(frames))

    def end(self) -> None:
        self._queue.put(None)

    def take(self, frames: Sequence[bytes | Target]) -> None:
        """`feed` on the calling thread: verify the frames now (a lookup whose frames land in its landing has nothing
        to dequantize while it reads, and its reader verifies each chunk itself rather than wake a thread for it)."""
        try:
            self._take(list(frames))
        except BaseException as exc:
            self.gate.fail(exc)
            raise

    def run(self, on_verified: Callable[[int, int], None]) -> None:
        """Until `end`: verify each chunk as it comes and dequantize whole frames while the queue is empty.
        Then `on_verified(good frames, their bytes)`, and the rest layer group by layer group."""
        try:
            self._run(on_verified)
        except BaseException as exc:  # whoever waits on the gate hears of it: never left waiting
            self.gate.fail(exc)
            raise

    def _take(self, item: list[bytes | Target]) -> None:
        opened, sizes = self._opened, self._sizes
        for frame in item:
            if self.stopped.is_set():
                break
            block = self._open_block(frame, len(opened))
            if block is None:
                self.stopped.set()
                break
            opened.append(block)
            sizes.append(len(frame))
        while self._done < len(opened) and self._queue.empty():
            done = self._done
            stop = min(len(opened), done + RUN_FRAMES)
            run = self._run_of(done, stop)
            if run is not None:  # a few landed frames in one call
                self.decode_seconds += self._into_context(done, stop, run)
                self._done = stop
                continue
            if self._in_landing(opened[done]):
                self._landed.append(done)
            elif not self._whole(opened[done], done):
                del opened[done:], sizes[done:]
                self._landed = [i for i in self._landed if i < done]
                self.stopped.set()
                break
            self._done += 1

    def _run(self, on_verified: Callable[[int, int], None]) -> None:
        try:
            while (item := self._queue.get()) is not None:
                self._take(item)
        finally:
            on_verified(len(self._opened), sum(self._sizes))
        opened, landed, done = self._opened, self._landed, self._done
        layers = self.gate.layers
        if landed or done < len(opened):  # the forward step dequantizes them as it reaches each layer
            runs, whole = self._runs(opened, landed + list(range(done, len(opened))))
            if runs:
                self.gate.hand_over(LandedRuns(self.out, self.block_tokens, self._on_decoded, self.decode_seconds,
                                               runs, [(i, opened[i]) for i in whole]))
                return
            done = min([done, *whole])  # no run after all: the old path, from the first frame not in place
        if done == len(opened):
            self.gate.release(layers)
            self._on_decoded(self.decode_seconds)
        elif self.layerwise:  # the forward step dequantizes each layer group when it reaches it, on its own cores
            self.gate.hand_over(LayerGroups(self.out, self.block_tokens, self._on_decoded, self.decode_seconds,
                                            opened[done:], done, max(1, -(-layers // LAYER_STEPS))))
        else:
            self._rest(done)
            self.gate.release(layers)

    def _in_landing(self, frame: OpenFrame) -> bool:
        """Whether `frame` was read in place from the landing and can be dequantized a layer at a time."""
        if self.landing is None or not frame.borrowed or frame.header.layer_bits or not frame.splits_by_layer:
            return False
        at = frame.address - ptr(self.landing)
        return 0 <= at < numel(self.landing)

    def _runs(self, opened: list[OpenFrame], pending: list[int]) -> tuple[list[tuple[int, FrameRun]], list[int]]:
        """The pending frames (block indices, ascending) as runs of consecutive blocks that dequantize layer by layer
        from the landing (`FrameRun`), and the blocks that do not (dequantized whole, before the first layer)."""
        runs: list[tuple[int, FrameRun]] = []
        whole: list[int] = []
        segments: list[list[int]] = []
        key: tuple[object, ...] = ()
        for i in pending:  # block 0 may have a codec of its own (blockcodec): a run of its own
            frame_key = (self._in_landing(opened[i]), opened[i].kind)
            if not segments or i != segments[-1][-1] + 1 or frame_key != key:
                segments.append([])
                key = frame_key
            segments[-1].append(i)
        for segment in segments:
            run = FrameRun.of(self.landing, [opened[i] for i in segment]) if self.landing is not None else None
            if run is not None:
                runs.append((segment[0], run))
            else:
                whole.extend(segment)
        return runs, whole

    def _run_of(self, first: int, stop: int) -> FrameRun | None:
        """Opened frames [first, stop) as one run of the landing (`FrameRun`: side by side, of one kind) of the
        context's block shape that dequantizes in one call (`decodes_whole`); None where they form none (or are one
        frame)."""
        if self._runs_from is None or stop - first < 2:
            return None
        run = FrameRun.of(self._runs_from, self._opened[first:stop])
        layers, _, heads, _, dim = self.out.shape
        if run is None or not run.decodes_whole or (
                run.header.layers, run.header.kv_heads, run.header.tokens, run.header.head_dim) != (
                layers, heads, self.block_tokens, dim):
            return None
        return run

    def _into_context(self, first: int, stop: int, run: FrameRun | None = None) -> float:
        """Opened frames [first, stop) into the context, every layer: in one call where they form a run (`run`, else
        `_run_of`), else one by one. Returns the seconds it took."""
        t0 = time.perf_counter()
        run = run or self._run_of(first, stop)
        if run is not None:
            b = self.block_tokens
            run.decode_into(self.out[:, :, :, first * b:stop * b])  # [L, 2, H, (stop - first) * b, D] view
        else:
            for k, frame in enumerate(self._opened[first:stop]):
                frame.decode_into(self.out[:, :, :, self._span(first + k)])  # [L, 2, H, b, D] view
        return time.perf_counter() - t0

    def _rest(self, first: int) -> None:
        """The opened frames from `first` on into the context, in pieces of RUN_FRAMES taken in turn by this thread
        and, where there is more than one, a helper thread (`helper`). The helper's task is withdrawn if it has not
        started by the time this thread is done: a pool whose threads all wait on helpers never deadlocks."""
        n = len(self._opened)
        pieces = iter([(i, min(n, i + RUN_FRAMES)) for i in range(first, n, RUN_FRAMES)])
        lock = threading.Lock()

        def take_pieces() -> float:
            spent = 0.0
            while True:
                with lock:
                    piece = next(pieces, None)
                if piece is None:
                    return spent
                spent += self._into_context(*piece)

        helped = self._helper.submit(take_pieces) if self._helper is not None and n - first > RUN_FRAMES else None
        try:
            spent = take_pieces()
        except BaseException:
            if helped is not None and not helped.cancel():
                futures.wait([helped])  # it writes into the context no more once this raises
            raise
        if helped is not None and not helped.cancel():
            spent += helped.result()
        self.decode_seconds += spent
        self._on_decoded(self.decode_seconds)

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
