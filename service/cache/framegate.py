"""The one gate for untrusted bytes: every frame, tail and reply entry read from Redis is checked here first.

A value is used only if it is exactly what this pod would have written (its header names this pod's codec, block
shape and dtype, its checksum holds); anything else is a counted miss (kvstash_cache_rejected_total by reason),
never an error and never a wrong answer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachestore.codec import CodecSpec, OpenFrame, read_header, verify_placed
from cachestore.codec.arrays import Array, is_torch_dtype, name_of, namespace
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.codec.frame import GROUPED_MODES, RunningChecksum
from cachestore.errors import CodecError, RetiredFrame
from cachestore.tails import unpack_ids, unpack_tail
from cachestore.wire import Scatter, Target
from service.engines import Engine
from service.runtime.metrics import PodMetrics

log = logging.getLogger("kvstash.gate")


@dataclass(frozen=True)
class Rejection:
    """Why a cached value was discarded: `reason` is a metric label (corrupt, retired, codec, model)."""

    reason: str
    detail: str


def frame_problem(
    frame: bytes | memoryview, spec: CodecSpec, shape: Sequence[int], dtype: Any,
) -> Rejection | None:
    """None if the frame's header names this pod's codec, block shape and dtype; a Rejection otherwise.

    A key already carries the model fingerprint and codec, so a mismatch here means corruption or a
    poisoned value: the codec would happily decode an int8 frame under an `exact` key, and a hit
    must never change the answer beyond the declared codec's loss. Only the header is parsed here
    (nothing is allocated); the caller decodes with the expected shape's element count as limit.
    """
    try:
        header = read_header(frame)
    except RetiredFrame as exc:  # written by a codec kvstash no longer has: a miss like any other
        return Rejection("retired", str(exc))
    except CodecError as exc:
        return Rejection("corrupt", str(exc))
    if header.mode != spec.mode or (header.mode in GROUPED_MODES and header.group_size != spec.group_size):
        return Rejection("codec", f"frame of codec {header.mode}/g{header.group_size}, this pod uses {spec.name()}")
    if header.transform != spec.transform:  # a rotated frame under a plain key, or the other way round
        return Rejection("codec", f"frame with transform bits {header.transform}, this pod's codec "
                                  f"{spec.name()} writes {spec.transform}")
    if header.layer_bits != spec.layer_table(header.layers):  # other layers one bit more
        return Rejection("codec", f"frame with layer table {header.layer_bits.hex()}, this pod uses {spec.name()}")
    want_dtype = name_of(dtype)
    if list(header.shape) != list(shape) or header.dtype != want_dtype:
        return Rejection("model", f"frame of shape {list(header.shape)} {header.dtype}, "
                                  f"expected {list(shape)} {want_dtype}")
    return None


class FrameGate:
    """Opens what a lookup read, or rejects it (counted): block frames, received bytes or in place, tails, reply ids.

    A frame received into the rows of a state the engine lent is verified there, and the engine says where it holds
    those rows (`Engine.placed_frame`). `mac_verified`: every block comes from a signing store, which returns only
    values whose MAC verified; the MAC covers a frame's checksum and all it covers, so the checksum is not checked
    again (every other check is).
    """

    def __init__(self, codecs: BlockCodecs, block_shape: tuple[int, ...], dtype: Any, metrics: PodMetrics,
                 engine: Engine, mac_verified: bool = False) -> None:
        self.codecs = codecs
        self.block_shape = block_shape  # [layers, 2, kv_heads, block_tokens, head_dim]
        self.dtype = dtype
        self.metrics = metrics
        self.engine = engine
        self.mac_verified = mac_verified

    def reject(self, problem: Rejection) -> None:
        """Bytes from Redis are untrusted: anything but what this pod would have written is a counted miss."""
        log.warning("discarding a cached frame (%s): %s", problem.reason, problem.detail)
        self.metrics.cache_rejected.labels(problem.reason).inc()

    def open_block(self, frame: bytes | Target, index: int) -> OpenFrame | None:
        """Block `index`'s frame verified and decompressed, or None (counted) if it is not what this pod
        would have written. A frame received as a `Scatter` (service.cache.placement) is verified where its rows lie."""
        codec = self.codecs.at(index)
        if isinstance(frame, Scatter):
            return self._open_placed(frame, index)
        problem = frame_problem(frame, codec.spec, self.block_shape, self.dtype)
        if problem is not None:
            self.reject(problem)
            return None
        try:
            return codec.open(frame, max_elements=math.prod(self.block_shape), mac_verified=self.mac_verified)
        except CodecError as exc:
            self.reject(Rejection("corrupt", str(exc)))
            return None

    def _open_placed(self, frame: Scatter, index: int) -> OpenFrame | None:
        """A frame received into a lent context's rows, verified there; one of the same length in another layout
        (a pod that wrote head-major fp16) is gathered out of them and opened as bytes."""
        head, rows = frame.pieces[0], frame.pieces[1:]
        problem = frame_problem(head, self.codecs.at(index).spec, self.block_shape, self.dtype)
        if problem is not None:
            self.reject(problem)
            return None
        apart = self.engine.kv_layout.rows_apart  # rows in a state beside the lent tensor (q8_0)
        if not read_header(head).rows:
            if apart:  # decoded into the tensor it would be missing from the state: never a wrong answer
                self.reject(Rejection("codec", "a frame of another layout than the state's rows"))
                return None
            return self.open_block(frame.tobytes(), index)
        try:
            running = frame.filled  # the checksum of the bytes as they came in, unless some did not come that way
            digest = running.value() if isinstance(running, RunningChecksum) and running.fed == len(frame) else None
            header = verify_placed(head, rows, digest=digest, max_elements=math.prod(self.block_shape),
                                   mac_verified=self.mac_verified)
        except CodecError as exc:
            self.reject(Rejection("corrupt", str(exc)))
            return None
        return self.engine.placed_frame(header, rows)  # where the engine holds the rows

    def decode(self, frame: bytes, tokens: int | None, block_index: int) -> Array | None:
        """A frame of `tokens` tokens (a whole block if None; fewer: a tail's or a session's partial block, in the
        codec of a partial block, `BlockCodecs.partial_at`) at block `block_index`, decoded in the model's dtype, or
        None (counted)."""
        expected = list(self.block_shape)
        if tokens is not None:
            expected[3] = tokens
        partial = tokens is not None and tokens < self.block_shape[3]
        codec = (self.codecs.partial_at if partial else self.codecs.at)(block_index)
        problem = frame_problem(frame, codec.spec, expected, self.dtype)
        if problem is not None:
            self.reject(problem)
            return None
        try:  # in the engine's library: a torch tensor on the CPU for a torch dtype, else a numpy array
            kv = codec.decode(frame, device="cpu" if is_torch_dtype(self.dtype) else None,
                              max_elements=math.prod(expected))
        except CodecError as exc:
            self.reject(Rejection("corrupt", str(exc)))
            return None
        return kv if kv.dtype == self.dtype else namespace(kv).astype(kv, self.dtype)

    def decode_into(self, frame: bytes, out: Array, start: int, tokens: int, block_index: int) -> bool:
        """`decode` straight into out[..., start:start + tokens]; False (counted) where it would be None."""
        expected = [*self.block_shape[:3], tokens, *self.block_shape[4:]]
        codec = self.codecs.at(block_index)
        problem = frame_problem(frame, codec.spec, expected, self.dtype)
        if problem is None:
            try:
                codec.decode_into(frame, out[:, :, :, start:start + tokens], max_elements=math.prod(expected))
                return True
            except CodecError as exc:
                problem = Rejection("corrupt", str(exc))
        self.reject(problem)
        return False

    def tail(self, value: bytes) -> tuple[list[int], bytes] | None:
        """A tail's token ids and its frame (not yet checked: `decode` it), or None (counted) if it does not parse."""
        try:
            tokens, frame = unpack_tail(value)
        except CodecError as exc:
            self.reject(Rejection("corrupt", f"tail: {exc}"))
            return None
        return tokens, frame

    def reply_ids(self, value: bytes) -> list[int] | None:
        """A reply entry's token ids, or None (counted) if it does not parse."""
        try:
            return unpack_ids(value)
        except CodecError as exc:
            self.reject(Rejection("corrupt", f"reply ids: {exc}"))
            return None
