"""Pipelined round trips on one of a client's connections, each reply of its target's length landing in it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from cachestore.wire.parser import Parser, make_parser
from cachestore.wire.resp import ProtocolError
from cachestore.wire.targets import Target


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
        self._reader: Parser | None = None
        self._unread = 0
        self._broken = False

    def send(self, commands: Sequence[tuple[Any, ...]]) -> None:
        try:  # no health check: a PING now would be answered after the replies still unread
            self._conn.send_packed_command(self._conn.pack_commands(commands), check_health=False)
            if self._reader is None:
                sock = self._conn._sock  # noqa: SLF001 - redis-py's socket, connected by now; plain or TLS
                if sock is None:
                    raise RedisConnectionError("the connection closed before its replies were read")
                self._reader = make_parser(sock)
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
