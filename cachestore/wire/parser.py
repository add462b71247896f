"""The one parser interface a connection's replies are read through, and the choice of parser for a socket."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence
from typing import Any, Protocol

from cachestore.wire.native import NativeParser, available
from cachestore.wire.resp import PythonParser
from cachestore.wire.targets import Target


class Parser(Protocol):
    """RESP replies off one socket; a bulk string of exactly `len(target)` bytes is received into `target`."""

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed."""
        ...

    def replies(self, count: int, targets: Sequence[Target | None] = ()) -> list[Any]:
        """The next `count` replies; reply `i` (i < len(targets)) lands in `targets[i]` when it is a bulk string of
        that length (and is then `targets[i]` itself)."""
        ...

    def reply(self, target: Target | None = None, depth: int = 0) -> Any:
        """One reply: bytes, int, None, a list, a ResponseError (returned, not raised), or `target` itself."""
        ...


def make_parser(sock: socket.socket, native: bool = True) -> Parser:
    """The native parser where `cachestore._resp` is built and `sock` is a plain socket (not TLS), else the Python
    one. `native=False`: the Python one (tests compare them)."""
    if native and available() and isinstance(sock, socket.socket) and not isinstance(sock, ssl.SSLSocket):
        return NativeParser(sock)
    return PythonParser(sock)
