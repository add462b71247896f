"""Pipelined reads whose large values land straight in the caller's buffer.

redis-py with hiredis copies a value three times on its way to Python: from the socket into the
connection's buffer, into hiredis's reader, and into a bytes object of its own. A hit at 2048 tokens
reads 24 MB of int8 frames and then dequantizes each frame from wherever its bytes object happens to be.
Here each value of the expected length is received with `recv_into` directly into its slot of one buffer
(one copy, the kernel's), so a lookup's frames lie side by side at a fixed stride, and one layer of every
block can be dequantized in a single call (`cachestore.codec.FrameRun`).

Replies are parsed in RESP2 and RESP3 (redis-py 8 speaks RESP3 by default); push messages, which a connection
without client tracking or subscriptions never receives, are refused and the connection dropped.

Where the native module `cachestore._resp` is built and the socket is plain TCP or Unix (not TLS), a run of values
expected in buffers is received by it, without the GIL: their headers parsed in C, each value read with readv
straight into its buffer or across a Scatter's pieces (each reported to `Scatter.filled`, with the GIL, as soon as it
is whole). Any other reply is left to the parser here. It leaves the reading thread less CPU to spend and the GIL
free, which shortens hits of many small pieces (a llama.cpp q8 hit's rows, 61 pieces a block) most.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_resp: ModuleType | None
try:
    import cachestore._resp as _resp
except ImportError:  # built without its compiler: every reply is parsed in Python
    _resp = None
NATIVE = _resp is not None  # whether runs of values in buffers can be received natively (plain sockets only)
# A Scatter that reports its pieces is received natively up to this size: llama.cpp's q8_0 rows (783 KB a block of
# SmolLM2) come in faster that way; its f16 rows (1.5 MB) did not, within the noise, so they keep the Python parser
NATIVE_REPORTED_BYTES = 1 << 20

_BUFFER = 1 << 16  # headers and small replies are read through this; a landed value bypasses it
MAX_BULK = 512 << 20  # Redis's own proto-max-bulk-len: a longer length is no Redis reply (bytes are untrusted)
MAX_DEPTH = 8  # nested aggregates; the commands read here nest at most 2 deep


class ProtocolError(RedisConnectionError):
    """The server sent something that is not a RESP reply: the connection is dropped."""


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


def _pieces(target: Target | None) -> tuple[memoryview, ...] | None:
    """Where the native reader lands a value for `target`, or None where the Python parser must take it (a view
    that is not bytes side by side)."""
    if isinstance(target, memoryview):
        return (target,) if target.ndim == 1 and target.itemsize == 1 and target.c_contiguous else None
    if isinstance(target, Scatter):
        if target.filled is not None and target.nbytes > NATIVE_REPORTED_BYTES:
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


def _integer(line: bytes) -> int:
    """The integer after a RESP header's type byte; a ProtocolError where there is none."""
    try:
        return int(line[1:])
    except ValueError as exc:
        raise ProtocolError(f"a malformed RESP header {line[:40]!r}") from exc


class ReplyReader:
    """RESP replies off one socket; a bulk string of exactly `len(target)` bytes is received into `target` (a buffer,
    or a `Scatter` of them)."""

    def __init__(self, sock: socket.socket, native: bool = True) -> None:
        """`native`: receive runs of values expected in buffers with `cachestore._resp` where it is built and `sock`
        is a plain socket (tests turn it off to compare)."""
        self._sock = sock
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._pos = self._end = 0
        self.native = native and _resp is not None and isinstance(sock, socket.socket) and not isinstance(
            sock, ssl.SSLSocket)

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
        that length, as `reply`. Runs of them are received natively where this reader can."""
        resp = _resp if self.native else None
        if resp is None:
            return [self.reply(targets[i] if i < len(targets) else None) for i in range(count)]
        plans = [_pieces(t) for t in targets[:count]]
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


def landable(client: Any) -> bool:
    """Whether `client` (a blocking redis-py client) can read into buffers: a single server or a Sentinel-managed
    master (a Cluster client routes each key itself and keeps its pools per node)."""
    pool = getattr(client, "connection_pool", None)
    return pool is not None and hasattr(pool, "get_connection")


class Exchange:
    """One of a client's connections for a series of pipelined round trips, each request sent before the replies
    of the one before are read if the caller likes (`send`, then `receive` in the same order): the next chunk's
    bytes come in while the caller works on this one's. Closed with replies unread, or after any failure, the
    connection is dropped (its state is unknown); else it goes back to the pool."""

    def __init__(self, client: Any) -> None:
        self._pool = client.connection_pool
        self._conn = self._pool.get_connection()
        self._reader: ReplyReader | None = None
        self._unread = 0
        self._broken = False

    def send(self, commands: Sequence[tuple[Any, ...]]) -> None:
        try:  # no health check: a PING now would be answered after the replies still unread
            self._conn.send_packed_command(self._conn.pack_commands(commands), check_health=False)
            if self._reader is None:
                sock = self._conn._sock  # noqa: SLF001 - redis-py's socket, connected by now; plain or TLS
                if sock is None:
                    raise RedisConnectionError("the connection closed before its replies were read")
                self._reader = ReplyReader(sock)
        except BaseException:
            self._broken = True
            raise
        self._unread += len(commands)

    def receive(self, count: int, targets: Sequence[Target | None] = ()) -> list[Any]:
        """The next `count` replies; reply `i` (i < len(targets)) lands in `targets[i]` when it is a bulk string of
        that length (and is then `targets[i]` itself)."""
        if self._reader is None or count > self._unread:
            raise ValueError(f"{count} replies asked for, {self._unread} requested")
        try:
            replies = self._reader.replies(count, targets)
            self._unread -= count
            if not self._unread and self._reader.buffered:
                raise ProtocolError("bytes after the last reply")
        except BaseException:
            self._broken = True
            raise
        return replies

    def close(self) -> None:
        if self._broken or self._unread:
            self._conn.disconnect()
        self._pool.release(self._conn)

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pipelined_into(client: Any, commands: Sequence[tuple[Any, ...]], targets: Sequence[Target | None]) -> list[Any]:
    """Send `commands` in one round trip on one of `client`'s connections and read their replies; reply `i`
    (i < len(targets)) lands in `targets[i]` when it is a bulk string of that length. On any failure the
    connection is dropped (its state is unknown) and the error raised."""
    with Exchange(client) as exchange:
        exchange.send(commands)
        return exchange.receive(len(commands), targets)
