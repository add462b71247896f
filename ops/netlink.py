"""A shaped network link between the benches and their Redis: a private network namespace whose loopback gives each
Redis port a link of its own, of a fixed rate and one-way delay, made with `ip netns` and `tc`.

All traffic stays on 127.0.0.1 inside the namespace: `NetLink.open()` moves the calling thread into it (setns), so
every Redis server, pod and client the bench starts afterwards (threads and processes inherit it) runs there. On the
namespace's `lo` an HTB root sorts packets by TCP port (u32); each shaped port gets two classes of the link's rate,
one for what the port sends (replies), one for what it receives (requests), each with a netem leaf adding the
delay (one way: a round trip pays it twice). Everything else (HTTP to the pods, the Cluster bus) passes unshaped,
so each shard of a Cluster sits behind a link of its own:

    lo  root htb 1:                        unclassified traffic: direct, unshaped
        class 1:<k>0  rate R  <- tcp sport P_k   leaf netem delay D     Redis P_k -> its clients
        class 1:<k>1  rate R  <- tcp dport P_k   leaf netem delay D     clients -> Redis P_k

`close()` kills what still runs in the namespace, steps back out and deletes it, on an error or Ctrl-C too (and on
SIGTERM, which it turns into SystemExit while the link is open); a namespace left by a killed run is removed by the
next one.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cachestore.errors import KvstashError

RATE_GBIT = (0.01, 100.0)
DELAY_MS = (0.0, 1000.0)
PREFIX = "kvstash-link-"
_STALE = re.compile(rf"^{PREFIX}(\d+)-\d+$")
_CLONE_NEWNET = 0x40000000
_counter = iter(range(1 << 30))


class LinkError(KvstashError):
    """A shaped link cannot be built here (bad rate or delay, not root, no `ip`/`tc`, a kernel without netem)."""


@dataclass(frozen=True)
class LinkSpec:
    """A link's rate each way (Gbit/s) and one-way delay (ms)."""

    gbit: float
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        low, high = RATE_GBIT
        if not (math.isfinite(self.gbit) and low <= self.gbit <= high):
            raise LinkError(f"--link-gbit must be {low:g} to {high:g} Gbit/s, got {self.gbit:g}")
        low, high = DELAY_MS
        if not (math.isfinite(self.delay_ms) and low <= self.delay_ms <= high):
            raise LinkError(f"--link-delay-ms must be {low:g} to {high:g} ms, got {self.delay_ms:g}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbit * 1e9 / 8

    def seconds(self, nbytes: int, links: int = 1) -> float:
        """What moving `nbytes` takes at the rate of `links` such links side by side: bytes x 8 / rate."""
        return nbytes / (self.bytes_per_s * links)


def add_link_args(parser: Any) -> None:
    """--link-gbit and --link-delay-ms, as every bench with a private Redis takes them."""
    parser.add_argument("--link-gbit", type=float, default=None, metavar="R",
                        help=f"put the private Redis (each shard of a Cluster) behind a link of R Gbit/s each way "
                             f"({RATE_GBIT[0]:g}-{RATE_GBIT[1]:g}; Linux network namespace + tc, as root)")
    parser.add_argument("--link-delay-ms", type=float, default=0.0, metavar="D",
                        help="and D ms of one-way delay on that link (default 0; needs the kernel's netem)")


def spec_of(args: Any) -> LinkSpec | None:
    """The link the bench's arguments ask for, checked before anything starts; None without --link-gbit."""
    gbit, delay = getattr(args, "link_gbit", None), float(getattr(args, "link_delay_ms", 0.0) or 0.0)
    if gbit is None:
        if delay:
            raise LinkError("--link-delay-ms needs --link-gbit (the link it delays)")
        return None
    spec = LinkSpec(float(gbit), delay)
    if getattr(args, "redis_url", None):
        raise LinkError("--link-gbit puts the bench's private Redis behind a link; an operator's --redis-url "
                        "already sits behind its own network: measure it without --link-*")
    check_host()
    return spec


def check_host() -> None:
    """Refuse in one line where no link can be made: not root, or no `ip` / `tc`."""
    if os.geteuid() != 0:
        raise LinkError("--link-gbit needs root (it creates a network namespace and tc qdiscs)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"--link-gbit needs {' and '.join(missing)} (iproute2) on PATH")


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
        raise LinkError(f"`{' '.join(cmd)}` failed: {said[-1]}")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise LinkError(f"setns: {os.strerror(ctypes.get_errno())}")


def _pids(name: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, the processes `pids` (all started inside a namespace of ours)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier links whose process is gone (killed before it could clean up)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False)
    removed = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _STALE.match(name)
        if match and not _alive(int(match.group(1))):
            _end(_pids(name))
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30, check=False)
            removed.append(name)
    return removed


@dataclass
class NetLink:
    """A network namespace of shaped links, one per Redis port given to `shape`; the opening thread works inside it
    until `close()`. Use it as a context manager."""

    spec: LinkSpec
    name: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{next(_counter)}")
    ports: list[int] = field(default_factory=list)
    _home: int | None = field(default=None, repr=False)
    _sigterm: Any = field(default=None, repr=False)

    def open(self) -> NetLink:
        check_host()
        remove_stale()
        _run("ip", "netns", "add", self.name)
        try:
            self._tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb")
            if self.spec.delay_ms:  # refuse now, before the bench starts anything, where netem is missing
                self._class(1)
                self._tc("class", "del", "dev", "lo", "classid", "1:1")
            self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            fd = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            _run("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def _tc(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.name, "tc", *args)

    def _class(self, classid: int) -> None:
        rate = f"{round(self.spec.gbit * 1e6)}kbit"
        burst = str(max(256 << 10, round(self.spec.bytes_per_s / 1000)))  # a 64 KiB loopback packet, or 1 ms
        self._tc("class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{classid:x}", "htb", "rate", rate,
                 "ceil", rate, "burst", burst, "cburst", burst, "quantum", "131072")
        if self.spec.delay_ms:
            try:
                self._tc("qdisc", "add", "dev", "lo", "parent", f"1:{classid:x}", "netem", "delay",
                         f"{self.spec.delay_ms:g}ms", "limit", "100000")
            except LinkError:
                raise LinkError("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): it cannot add a delay; "
                                "run with --link-delay-ms 0") from None

    def shape(self, *ports: int) -> None:
        """Put each of `ports` (a Redis server listening inside the namespace) behind a link of its own."""
        for port in ports:
            k = 0x10 * (len(self.ports) + 1)
            self._class(k)
            self._class(k + 1)
            for direction, classid in (("sport", k), ("dport", k + 1)):
                self._tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", "protocol", "6", "0xff", "match", "ip", direction, str(port), "0xffff",
                         "flowid", f"1:{classid:x}")
            self.ports.append(port)

    def carried(self) -> dict[int, tuple[int, int]]:
        """Bytes each shaped port's link has carried so far: {port: (sent by the port, sent to it)}."""
        done = subprocess.run(["ip", "netns", "exec", self.name, "tc", "-s", "class", "show", "dev", "lo"],
                              capture_output=True, text=True, timeout=30, check=True)
        sent: dict[str, int] = {}
        classid = ""
        for line in done.stdout.splitlines():
            words = line.split()
            if words[:2] == ["class", "htb"]:
                classid = words[2]
            elif words[:1] == ["Sent"] and classid:
                sent[classid] = int(words[1])
        return {port: (sent.get(f"1:{0x10 * (i + 1):x}", 0), sent.get(f"1:{0x10 * (i + 1) + 1:x}", 0))
                for i, port in enumerate(self.ports)}

    def describe(self) -> str:
        """One line: what was built."""
        each = "a link each" if len(self.ports) > 1 else "one link"
        return (f"link: {self.spec.gbit:g} Gbit/s each way, {self.spec.delay_ms:g} ms one-way delay, for Redis port"
                f"{'s' if len(self.ports) > 1 else ''} {', '.join(map(str, self.ports))} ({each}), "
                f"network namespace {self.name} (tc htb{' + netem' if self.spec.delay_ms else ''} on its loopback)")

    def as_json(self) -> dict[str, Any]:
        return {"gbit": self.spec.gbit, "delay_ms": self.spec.delay_ms, "links": len(self.ports),
                "namespace": self.name, "how": "netns loopback, tc htb per port" +
                (" + netem delay" if self.spec.delay_ms else "")}

    def close(self) -> None:
        """Step back out, end what still runs inside, delete the namespace. Safe to call twice."""
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        if self._home is not None:
            _setns(self._home)
            os.close(self._home)
            self._home = None
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False)
        if any(line.split()[:1] == [self.name] for line in names.stdout.splitlines()):
            _end(_pids(self.name))
            _run("ip", "netns", "del", self.name)

    def __enter__(self) -> NetLink:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def opened(spec: LinkSpec | None) -> Iterator[NetLink | None]:
    """The link of `spec`, open for the block (None, and nothing done, without one)."""
    if spec is None:
        yield None
        return
    with NetLink(spec) as link:
        yield link


def ping_rtt_ms(port: int, count: int = 5) -> float:
    """The median round trip of a Redis PING to 127.0.0.1:`port` (twice the link's delay, plus Redis)."""
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(b"PING\r\n")
            if not sock.recv(64).startswith(b"+PONG"):
                raise LinkError(f"port {port} did not answer PING")
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def link_fields(spec: LinkSpec, nbytes: int, links: int, seconds: float, busiest: int = 0) -> dict[str, Any]:
    """What a bench row records of its link: the rate, delay and number of links, the link's arithmetic for `nbytes`
    spread evenly over `links` (bytes x 8 / rate, ms; or the `busiest` link's bytes x 8 / rate, where the bytes are
    not spread evenly), and what `seconds` (the measured read) made of it."""
    arithmetic = spec.seconds(busiest) if busiest else spec.seconds(nbytes, links)
    return {"link_gbit": spec.gbit, "link_delay_ms": spec.delay_ms, "links": links,
            "link_ms": round(arithmetic * 1000, 2), "gbit_s": round(nbytes * 8 / seconds / 1e9, 3),
            "to_link": round(seconds / arithmetic, 3)}
