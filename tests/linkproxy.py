"""Test helper (no tests): a TCP proxy on a free port whose replies flow at a fixed rate, standing for a slow link."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Self

from ops.redisproc import free_port

CHUNK = 4096  # bytes forwarded at a time


class LinkProxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream_port`, one connection upstream for each client; a subclass
    says what flows each way (`_connect`). Use it as a context manager."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> Self:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            self._connect(client, upstream)

    def _connect(self, client: socket.socket, upstream: socket.socket) -> None:
        raise NotImplementedError


class ThrottledLink(LinkProxy):
    """A link whose replies (what the upstream sends back) are paced to `reply_bytes_s` per connection; requests
    pass at full speed."""

    def __init__(self, upstream_port: int, reply_bytes_s: float) -> None:
        super().__init__(upstream_port)
        self.reply_bytes_s = reply_bytes_s
        self.replied = 0  # bytes sent back so far, over every connection

    def _connect(self, client: socket.socket, upstream: socket.socket) -> None:
        threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, self.reply_bytes_s), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, rate: float | None) -> None:
        free_at = 0.0  # when the paced direction may send again: each chunk holds it for len / rate, no credit saved
        try:
            while True:
                data = source.recv(CHUNK)
                if not data:
                    break
                if rate is not None:
                    wait = free_at - time.monotonic()
                    if wait > 0:  # the wait is the test: the link's rate
                        time.sleep(wait)
                    free_at = time.monotonic() + len(data) / rate
                sink.sendall(data)
                if rate is not None:
                    with self._lock:
                        self.replied += len(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()
