"""Is a frame read from Redis exactly what this pod would have written? Checked before any decode."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachestore.codec import CodecSpec, read_header
from cachestore.codec.frame import GROUPED_MODES
from cachestore.errors import CodecError


@dataclass(frozen=True)
class Rejection:
    """Why a cached value was discarded: `reason` is a metric label (corrupt, codec, model)."""

    reason: str
    detail: str


def frame_problem(
    frame: bytes | memoryview, spec: CodecSpec, shape: Sequence[int], dtype: torch.dtype,
) -> Rejection | None:
    """None if the frame's header names this pod's codec, block shape and dtype; a Rejection otherwise.

    A key already carries the model fingerprint and codec, so a mismatch here means corruption or a
    poisoned value: the codec would happily decode an int8 frame under an `exact` key, and a hit
    must never change the answer beyond the declared codec's loss. Only the header is parsed here
    (nothing is allocated); the caller decodes with the expected shape's element count as limit.
    """
    try:
        header = read_header(frame)
    except CodecError as exc:
        return Rejection("corrupt", str(exc))
    if header.mode != spec.mode or (header.mode in GROUPED_MODES and header.group_size != spec.group_size):
        return Rejection("codec", f"frame of codec {header.mode}/g{header.group_size}, this pod uses {spec.name()}")
    if header.transform != spec.transform:  # a rotated frame under a plain key, or the other way round
        return Rejection("codec", f"frame with transform bits {header.transform}, this pod's codec "
                                  f"{spec.name()} writes {spec.transform}")
    if header.layer_bits != spec.layer_table(header.layers):  # other layers kept at int8 (format 3)
        return Rejection("codec", f"frame with layer table {header.layer_bits.hex()}, this pod uses {spec.name()}")
    want_dtype = str(dtype).removeprefix("torch.")
    if list(header.shape) != list(shape) or header.dtype != want_dtype:
        return Rejection("model", f"frame of shape {list(header.shape)} {header.dtype}, "
                                  f"expected {list(shape)} {want_dtype}")
    return None
