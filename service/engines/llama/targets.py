"""Landing targets in a lent sequence state: each block's token-rows frame received with its header apart and its
rows where the state holds them (`cachestore.landing.Scatter`), checksummed as they arrive unless signed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import overload

from cachestore.codec.frame import HEADER_SIZE, RunningChecksum
from cachestore.wire import Scatter, Target

# where cells [start, start + count) of a lent context hold their rows (per layer its K, then its V), or None
RowsOf = Callable[[int, int], "list[memoryview] | None"]


class _Made(Sequence[Target]):
    """`make(i)` for i in [start, stop), made when read; a slice is another such sequence."""

    def __init__(self, make: Callable[[int], Target], start: int, stop: int) -> None:
        self._make, self._start, self._stop = make, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> Target: ...

    @overload
    def __getitem__(self, index: slice) -> _Made: ...

    def __getitem__(self, index: int | slice) -> Target | _Made:
        if isinstance(index, slice):
            first, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("slices of a _Made take no step")
            return _Made(self._make, self._start + first, self._start + max(first, stop))
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self._make(self._start + index % len(self))


def row_targets(rows_of: RowsOf, blocks: int, block_tokens: int,
                checksummed: bool = True) -> Sequence[Target] | None:
    """Each of `blocks` blocks' `Scatter` into a lent context whose rows `rows_of` finds; None when the context
    holds no rows for them. Each is made when the reader asks for its chunk (~17 µs a block: 2 ms before the first
    request at 8128 tokens). `checksummed`: each checksums its bytes as they land; a signed value's MAC covers its
    checksum, so signed rows land unreported, through the native reader whatever their size."""
    b = block_tokens
    if rows_of((blocks - 1) * b, b) is None:
        return None
    headers = memoryview(bytearray(HEADER_SIZE * blocks))

    def scatter(i: int) -> Target:
        rows = rows_of(i * b, b)
        assert rows is not None
        return Scatter([headers[i * HEADER_SIZE:(i + 1) * HEADER_SIZE], *rows],
                       RunningChecksum() if checksummed else None)

    return _Made(scatter, 0, blocks)
