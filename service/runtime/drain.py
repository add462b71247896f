"""Leaving cleanly: what a pod (`kvstash serve`, `kvstash sidecar`) does on SIGTERM.

uvicorn already does most of it: on SIGTERM (or SIGINT) it closes its listening sockets, so new connections are
refused (a balancer retries a refused connection on another pod: it never reached this one), closes idle keep-alive
connections, lets the requests in flight finish, and then runs the app's lifespan shutdown, where the pod drains its
write-back queue (service.app). `DrainingServer` keeps all of that and adds what a fleet needs:

- the pod reports not ready from the signal on: /readyz answers 503 and `kvstash_draining` is 1 (`Drain.active`);
- an optional lame-duck delay (`drain_delay_s`, 0 by default): the listener stays open that long, serving requests
  with `Connection: close`, for balancers that learn of a leaving pod only from its readiness probe;
- a bound: the whole drain, requests then write-back, ends within `drain_grace_s` of the first signal; past it, or on a
  second SIGTERM or SIGINT, the process exits at once with status 1, whatever it still held;
- exit status 0 after a clean drain: uvicorn raises the captured signal again once it has shut down, so the process
  would die of SIGTERM (status 143), which supervisors and Kubernetes read as a crash;
- one log line when draining starts, one when it ends (service.app logs the end, after the write-back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

log = logging.getLogger("kvstash.drain")
EXIT_CUT_SHORT = 1  # the status of a drain ended by a second signal or by the grace period


@dataclass
class Drain:
    """A pod's drain: not begun until the first SIGTERM. `holding` says what the pod still holds (requests in
    flight, write-back jobs queued): the pod's lifespan sets it, the log lines read it."""

    grace_s: float = 25.0
    delay_s: float = 0.0
    started: float | None = None  # time.monotonic() of the first signal
    holding: Callable[[], tuple[int, int]] = field(default=lambda: (0, 0), repr=False)

    @property
    def active(self) -> bool:
        return self.started is not None

    def begin(self) -> bool:
        """Start draining; False if it had started already."""
        if self.started is not None:
            return False
        self.started = time.monotonic()
        return True

    def left_s(self) -> float:
        """Seconds of the grace period left (all of it before the drain begins)."""
        if self.started is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.started))

    def elapsed_s(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def describe(self) -> str:
        requests, writes = self.holding()
        return f"{requests} requests in flight, {writes} writes queued"


def _exit_now(why: str) -> None:
    """End the process at once (from a signal handler or the grace timer): no lifespan, no atexit, no waiting for the
    compute thread. A spawned llama-server dies with it (PR_SET_PDEATHSIG); Redis holds only whole values."""
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), f"kvstash: {why}: exiting now\n".encode())
    os._exit(EXIT_CUT_SHORT)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the pod's drain (the module's docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if not self.drain.begin():  # a second signal: the operator (or the kubelet's grace) wants it gone now
            _exit_now(f"{name} while draining ({self.drain.describe()})")
        if self.drain.delay_s <= 0:
            self.should_exit = True  # uvicorn's own shutdown: the listener closes at its next tick (0.1 s)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._draining, name)

    def _draining(self, name: str) -> None:
        """On the event loop, just after the first signal: the log line, the grace timer, the lame-duck delay."""
        drain = self.drain
        delay = f"; listening {drain.delay_s:g} s more, not ready" if drain.delay_s > 0 else ""
        log.info("draining on %s: not ready, %s; ends within %g s%s", name, drain.describe(), drain.grace_s, delay)
        timer = threading.Timer(drain.left_s(), self._grace_over)
        timer.daemon = True
        timer.start()
        if drain.delay_s > 0 and self._loop is not None:
            self._loop.call_later(drain.delay_s, self._stop_listening)

    def _stop_listening(self) -> None:
        self.should_exit = True

    def _grace_over(self) -> None:
        _exit_now(f"the drain's grace period ({self.drain.grace_s:g} s) ran out ({self.drain.describe()})")

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, less raising the captured signal again once the server has shut down: a drained pod exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(app: Any, drain: Drain, host: str, port: int, log_level: str) -> None:
    """Run `app` until a signal has drained it (uvicorn waits for the requests in flight however long they take: the
    grace timer bounds the whole drain instead)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None)
    server = DrainingServer(config, drain)
    server.run()
    if not server.started:  # start-up failed (said in the log): not a clean exit
        raise SystemExit(3)
