"""Where a reply's bytes land: a buffer of the caller's (a memoryview) or a `Scatter` of several."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Scatter:
    """Where one value goes when its bytes belong in several places: `pieces`, in order. A frame of token rows
    (`CodecSpec.rows`) is received with its header in a buffer of its own and each layer's K and V rows straight
    where a llama.cpp sequence state holds them, so a hit needs no copy after the wire."""

    __slots__ = ("filled", "nbytes", "pieces")

    def __init__(self, pieces: Sequence[memoryview], filled: Callable[[memoryview], None] | None = None) -> None:
        """`filled(piece)`, if given, is called with each piece as soon as it holds its bytes, in order (while the
        piece is still in the cache: checksumming a frame as it arrives costs half what it does afterwards)."""
        self.pieces = [p if p.format == "B" and p.ndim == 1 else p.cast("B") for p in pieces]
        self.nbytes = sum(len(p) for p in self.pieces)
        self.filled = filled

    def __len__(self) -> int:
        return self.nbytes

    @property
    def reports_pieces(self) -> bool:
        """Whether its pieces are each reported as they land (which decides how it is received:
        `cachestore.wire.native.native_pieces`)."""
        return self.filled is not None

    def fill(self, data: bytes | memoryview) -> None:
        """Write `data` (exactly `len(self)` bytes) across the pieces."""
        if len(data) != self.nbytes:
            raise ValueError(f"{len(data)} bytes for a scatter of {self.nbytes}")
        view, at = memoryview(data).cast("B"), 0
        for piece in self.pieces:
            piece[:] = view[at:at + len(piece)]
            at += len(piece)
            if self.filled is not None:
                self.filled(piece)

    def tobytes(self) -> bytes:
        return b"".join(self.pieces)


Target = memoryview | Scatter  # where a reply of its length is received
