"""Test helper (no tests): a TCP proxy to Redis that tears one write in half, standing for a writer killed mid-write.

Requests pass whole until the `whole + 1`-th value larger than `big` bytes (a block frame): of that one only the first
half goes to Redis, then the connection freezes (nothing more is forwarded either way) and `cut` is set. Kill the
writer then: its socket closes, the proxy closes its side to Redis, and Redis holds half a command it never ran.
Replies of the other connections flow as they come."""

from __future__ import annotations

import socket
import threading

from tests.linkproxy import LinkProxy


class RespCutter:
    """Walks a client's RESP requests (arrays of bulk strings) as they arrive: what may go to Redis now."""

    def __init__(self, big: int, whole: int) -> None:
        self.big, self.whole = big, whole
        self.seen = 0  # values over `big` so far
        self.cut = False
        self._buf = bytearray()
        self._data_left = 0  # bytes of the current bulk (with its CRLF) still to pass
        self._cutting = False  # the current bulk is the one torn: stop once `_data_left` reaches 0

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while self._buf and not self.cut:
            if self._data_left:
                n = min(self._data_left, len(self._buf))
                out += self._buf[:n]
                del self._buf[:n]
                self._data_left -= n
                self.cut = self._cutting and self._data_left == 0
                continue
            end = self._buf.find(b"\r\n")
            if end < 0:
                break
            line = bytes(self._buf[:end + 2])
            out += line
            del self._buf[:end + 2]
            if line[:1] != b"$":
                continue  # an array header: its bulks follow
            length = int(line[1:-2])
            self._data_left = length + 2
            if length > self.big:
                self.seen += 1
                if self.seen > self.whole:
                    self._cutting, self._data_left = True, length // 2
        return bytes(out)


class TornLink(LinkProxy):
    """Forwards 127.0.0.1:`port` to Redis on `upstream_port`, tearing one large value (module docstring)."""

    def __init__(self, upstream_port: int, big: int = 65536, whole: int = 0) -> None:
        super().__init__(upstream_port)
        self.cut = threading.Event()
        self._frozen = False
        self._cutter = RespCutter(big, whole)  # shared by every connection: the writer's pool may use any

    def _connect(self, client: socket.socket, upstream: socket.socket) -> None:
        cutter = RespCutter(self._cutter.big, self._cutter.whole)
        threading.Thread(target=self._requests, args=(client, upstream, cutter), daemon=True).start()
        threading.Thread(target=self._replies, args=(upstream, client), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, cutter: RespCutter) -> None:
        try:
            while data := client.recv(65536):
                with self._lock:  # the count of large values is the link's, over every connection
                    if self._frozen:
                        return  # nothing more reaches Redis
                    cutter.seen = self._cutter.seen
                    out = cutter.feed(data)
                    self._cutter.seen = cutter.seen
                    self._frozen = cutter.cut
                upstream.sendall(out)
                if cutter.cut:
                    self.cut.set()  # once what passed is on its way to Redis
                    while client.recv(65536):
                        pass  # frozen: the rest of the command never reaches Redis, until the writer dies
                    return
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                try:
                    sock.close()
                except OSError:
                    pass

    def _replies(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass
