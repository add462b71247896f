"""How `kvstash bench load`'s client reaches the pods: through nginx, or, when nginx is not installed, by
choosing the pod itself the way the demo's nginx would: round robin, or a consistent hash on the session for the
sticky-sessions baseline, and a pod that failed a request is passed over for FAIL_TIMEOUT_S (nginx's
`max_fails=1 fail_timeout=5s`), its requests going to the next pod of the rotation or the ring."""

from __future__ import annotations

import bisect
import itertools
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Protocol

POINTS_PER_POD = 160  # as nginx's `hash ... consistent` (ketama): points per server of weight 1
FAIL_TIMEOUT_S = 5.0  # as ops/nginx/demo.conf.template's servers


class Router(Protocol):
    name: str

    def pick(self, key: str) -> str:
        """The base URL for a request of session `key`."""
        ...

    def failed(self, url: str) -> None:
        """A request to `url` failed (refused, reset, 502): pass it over for a while."""
        ...


class ViaBalancer:
    """Every request to the balancer; it does the routing (and the passing over of a pod that does not answer)."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name

    def pick(self, key: str) -> str:
        return self.url

    def failed(self, url: str) -> None:
        pass


class _Health:
    """Pods passed over until a moment, after a failure (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}

    def failed(self, url: str) -> None:
        with self._lock:
            self._down_until[url] = time.monotonic() + FAIL_TIMEOUT_S

    def up(self, url: str) -> bool:
        with self._lock:
            return self._down_until.get(url, 0.0) <= time.monotonic()


class RoundRobin(_Health):
    """The next pod of the rotation for every request, whatever its session."""

    name = "client round robin"

    def __init__(self, urls: Sequence[str]) -> None:
        super().__init__()
        self._urls = list(urls)
        self._rotation = itertools.cycle(self._urls)
        self._turn = threading.Lock()

    def pick(self, key: str) -> str:
        with self._turn:
            for _ in self._urls:
                url = next(self._rotation)
                if self.up(url):
                    return url
            return next(self._rotation)  # every pod failed lately: try anyway


class ConsistentHash(_Health):
    """The pod owning `key` on a hash ring, or the next one clockwise while it is passed over."""

    name = "client consistent hash"

    def __init__(self, urls: Sequence[str]) -> None:
        super().__init__()
        if not urls:
            raise ValueError("no pods to route to")
        points = sorted((zlib.crc32(f"{url}-{i}".encode()), url) for url in urls for i in range(POINTS_PER_POD))
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]

    def owners(self, key: str) -> list[str]:
        """Every pod, in the order the ring offers them to `key`."""
        i = bisect.bisect_left(self._hashes, zlib.crc32(key.encode()))
        ordered = self._urls[i:] + self._urls[:i]
        return list(dict.fromkeys(ordered))

    def pick(self, key: str) -> str:
        owners = self.owners(key)
        return next((url for url in owners if self.up(url)), owners[0])
