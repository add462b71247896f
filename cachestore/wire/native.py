"""The native RESP receive (`cachestore/_resp.c`) behind the parser interface: runs of values expected in buffers
received without the GIL, their headers parsed in C, each value read with readv straight into its buffer or across
a Scatter's pieces (each reported to `Scatter.filled`, with the GIL, as soon as it is whole). Any other reply is left
to the Python parser. Plain TCP or Unix sockets only (not TLS).

It leaves the reading thread less CPU to spend and the GIL free, which shortens hits of many small pieces (a
llama.cpp q8 hit's rows, 61 pieces a block) most.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cachestore.wire.resp import ProtocolError, PythonParser
from cachestore.wire.targets import Scatter, Target

_resp: ModuleType | None
try:
    import cachestore._resp as _resp
except ImportError:  # built without its compiler: every reply is parsed in Python
    _resp = None
NATIVE = _resp is not None  # whether runs of values in buffers can be received natively (plain sockets only)
# A Scatter that reports its pieces is received natively up to this size: llama.cpp's q8_0 rows (783 KB a block of
# SmolLM2) come in faster that way; its f16 rows (1.5 MB) did not, within the noise, so they keep the Python parser
NATIVE_REPORTED_BYTES = 1 << 20


def available() -> bool:
    """Whether the native module is there now (tests take it away to compare the parsers)."""
    return _resp is not None


def native_pieces(target: Target | None) -> tuple[memoryview, ...] | None:
    """Where the native reader lands a value for `target`, or None where the Python parser must take it (a view
    that is not bytes side by side)."""
    if isinstance(target, memoryview):
        return (target,) if target.ndim == 1 and target.itemsize == 1 and target.c_contiguous else None
    if isinstance(target, Scatter):
        if target.reports_pieces and target.nbytes > NATIVE_REPORTED_BYTES:
            return None
        return tuple(target.pieces) if all(p.c_contiguous for p in target.pieces) else None
    return None


def _failure(status: int, errno: int) -> Exception:
    """What a failed native receive (`_resp.receive`'s status) raises, as the Python parser would."""
    if status == 2:
        return RedisTimeoutError("Timeout reading from Redis")
    if status == 3:
        return ProtocolError("a bulk string not followed by CRLF")
    if status == 4:
        return RedisConnectionError(f"reading from Redis: {os.strerror(errno)}")
    return RedisConnectionError("Redis closed the connection mid-reply")


class NativeParser(PythonParser):
    """The Python parser, with runs of replies expected in buffers received by `cachestore._resp`."""

    def replies(self, count: int, targets: Sequence[Target | None] = ()) -> list[Any]:
        """The next `count` replies; reply `i` (i < len(targets)) lands in `targets[i]` when it is a bulk string of
        that length, as `reply`. Runs of them are received natively."""
        resp = _resp
        assert resp is not None
        plans = [native_pieces(t) for t in targets[:count]]
        filled = [t.filled if isinstance(t, Scatter) else None for t in targets[:count]]
        got: list[Any] = []
        while len(got) < count:
            at = len(got)
            if at < len(plans) and plans[at] is not None:
                timeout = self._sock.gettimeout()
                at, self._pos, self._end, status, errno = resp.receive(
                    self._sock.fileno(), -1.0 if timeout is None else timeout, self._buf, self._pos, self._end,
                    plans, filled, at, count)
                got.extend(targets[len(got):at])
                if status:
                    raise _failure(status, errno)
                if at == count:
                    break
            got.append(self.reply(targets[at] if at < len(targets) else None))  # any other reply
        return got
