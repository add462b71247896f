"""The RESP reader in Python: replies off one socket, a value of its target's length received straight into it.

Replies are parsed in RESP2 and RESP3 (redis-py 8 speaks RESP3 by default); push messages, which a connection
without client tracking or subscriptions never receives, are refused and the connection dropped. Bytes from Redis are
untrusted: every length is checked before anything is allocated.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from cachestore.wire.targets import Scatter, Target

_BUFFER = 1 << 16  # headers and small replies are read through this; a landed value bypasses it
MAX_BULK = 512 << 20  # Redis's own proto-max-bulk-len: a longer length is no Redis reply (bytes are untrusted)
MAX_DEPTH = 8  # nested aggregates; the commands read here nest at most 2 deep


class ProtocolError(RedisConnectionError):
    """The server sent something that is not a RESP reply: the connection is dropped."""


def _integer(line: bytes) -> int:
    """The integer after a RESP header's type byte; a ProtocolError where there is none."""
    try:
        return int(line[1:])
    except ValueError as exc:
        raise ProtocolError(f"a malformed RESP header {line[:40]!r}") from exc

class PythonParser:
    """RESP2 and RESP3 replies off one socket, parsed in Python; a bulk string of exactly `len(target)` bytes is
    received into `target` (a buffer, or a `Scatter` of them)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._pos = self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed."""
        return self._end - self._pos

    def _fill(self) -> None:
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):  # a header split at the buffer's end: move what is left to the front
            left = self._end - self._pos
            self._buf[:left] = self._buf[self._pos:self._end]
            self._pos, self._end = 0, left
        got = self._sock.recv_into(self._view[self._end:])
        if not got:
            raise RedisConnectionError("Redis closed the connection mid-reply")
        self._end += got

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._pos, self._end)
            if at >= 0:
                line = bytes(self._buf[self._pos:at])
                self._pos = at + 2
                return line
            if self._end - self._pos >= len(self._buf) - 2:
                raise ProtocolError("a RESP header longer than 64 KiB")
            self._fill()

    def _exactly(self, target: memoryview | Scatter) -> None:
        if isinstance(target, Scatter):
            for piece in target.pieces:  # one receive per piece at least: 60 a SmolLM2 frame, 24 KiB each
                self._exactly(piece)
                if target.filled is not None:
                    target.filled(piece)
            return
        want = len(target)
        have = min(want, self._end - self._pos)
        target[:have] = self._view[self._pos:self._pos + have]
        self._pos += have
        while have < want:
            got = self._sock.recv_into(target[have:], want - have)
            if not got:
                raise RedisConnectionError("Redis closed the connection mid-value")
            have += got

    def _crlf(self) -> None:
        while self._end - self._pos < 2:
            self._fill()
        if self._buf[self._pos:self._pos + 2] != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        self._pos += 2

    def replies(self, count: int, targets: Sequence[Target | None] = ()) -> list[Any]:
        """The next `count` replies; reply `i` (i < len(targets)) lands in `targets[i]` when it is a bulk string of
        that length, as `reply`."""
        return [self.reply(targets[i] if i < len(targets) else None) for i in range(count)]

    def reply(self, target: Target | None = None, depth: int = 0) -> Any:
        """One reply: bytes, int, None, a list, a ResponseError (returned, not raised, as redis-py's
        `raise_on_error=False`), or `target` itself when a bulk string of its length was received into it."""
        if depth > MAX_DEPTH:
            raise ProtocolError(f"a reply nested more than {MAX_DEPTH} deep")
        line = self._line()
        kind, rest = line[:1], line[1:]
        # only the header's own numbers are parsed under ProtocolError: a callback's ValueError (Scatter.filled) is
        # not a malformed header
        size = _integer(line) if kind in (b"$", b"=", b"!") else 0
        if size > MAX_BULK:
            raise ProtocolError(f"a bulk string of {size} bytes, over {MAX_BULK}")
        if kind == b"$":
            if size < 0:
                return None
            if target is not None and size == len(target):
                self._exactly(target)
                self._crlf()
                return target
            value = bytearray(size)
            self._exactly(memoryview(value))
            self._crlf()
            return bytes(value)
        if kind == b":" or kind == b"(":  # an integer; RESP3's big number
            return _integer(line)
        if kind == b"+":
            return rest
        if kind == b"-":
            return ResponseError(rest.decode("utf-8", "replace"))
        if kind == b"*" or kind == b"~":  # an array; RESP3's set
            count = _integer(line)
            return None if count < 0 else [self.reply(None, depth + 1) for _ in range(count)]
        if kind == b"_":  # RESP3's null
            return None
        if kind == b"%":  # RESP3's map, as redis-py gives it
            return {self.reply(None, depth + 1): self.reply(None, depth + 1) for _ in range(_integer(line))}
        if kind == b"#":
            return rest == b"t"
        if kind == b",":
            try:
                return float(rest)
            except ValueError as exc:
                raise ProtocolError(f"a malformed RESP header {line[:40]!r}") from exc
        if kind in (b"=", b"!"):  # verbatim string (its "txt:" prefix dropped); blob error
            if size < 0:
                raise ProtocolError(f"a malformed RESP header {line[:40]!r}")
            value = bytearray(size)
            self._exactly(memoryview(value))
            self._crlf()
            return bytes(value[4:]) if kind == b"=" else ResponseError(value.decode("utf-8", "replace"))
        if kind == b"|":  # attributes of the reply that follows: not needed
            for _ in range(2 * _integer(line)):
                self.reply(None, depth + 1)
            return self.reply(target, depth)
        raise ProtocolError(f"an unexpected RESP reply type {line[:40]!r}")
