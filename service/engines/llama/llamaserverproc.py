"""One llama-server process started and supervised by the sidecar (`--spawn`): restarted when it dies.

A restarted llama-server has empty slots; the engine notices (llama-server's own timings show the prompt
prefilled) and treats it as a miss, so supervision needs no coordination with requests in flight.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from cachestore.errors import ConfigError

log = logging.getLogger("kvstash.llamaserver")

ROOT = Path(__file__).resolve().parents[3]  # the checkout: service/engines/llama/ is three below it
DEFAULT_BINARY = ROOT / ".venv" / "llama-server" / "bin" / "llama-server"  # what `make setup` builds
START_TIMEOUT_S = 120.0
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until GET /health answers 200 (the model is loaded); raises ConfigError on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ConfigError(f"llama-server exited with code {proc.returncode} while starting (see its log)")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise ConfigError(f"llama-server at {url} did not become healthy within {timeout_s:.0f} s")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the sidecar dies, even by SIGKILL (Linux), so no orphaned
    llama-server keeps its port and memory. Not SIGTERM: a llama-server already shutting down (the sidecar's
    `stop`) takes a second SIGTERM as "exit now" and calls exit() in its signal handler, which can deadlock on the
    allocator's lock it interrupted, leaving it asleep forever. (Linux ties this to the thread that started the
    child: a llama-server started from a thread that then ends is stopped, and the watcher restarts it.)"""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class LlamaServerProcess:
    """llama-server on 127.0.0.1:`port` with `parallel` slots saving into `slot_dir`; restarted if it dies."""

    def __init__(
        self, model: Path, slot_dir: Path, *, parallel: int, ctx_per_slot: int, threads: int = 0,
        binary: Path | None = None, port: int = 0, extra_args: Sequence[str] = (), log_path: Path | None = None,
        api_key: str = "",
    ) -> None:
        self.binary = binary or DEFAULT_BINARY
        if not self.binary.is_file():
            raise ConfigError(f"no llama-server binary at {self.binary}: run `make setup` (builds it) or pass "
                              "--llama-server PATH")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # kvstash is the prompt cache here: llama-server's own RAM cache (8 GiB by default) stays off unless the
        # arguments after -- turn it on (`--cache-ram N`: the fleet bench measures the sidecar with both caches)
        own_cache = any(a in ("--cache-ram", "-cram") for a in extra_args)
        self.args = [
            str(self.binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--slot-save-path", str(slot_dir) + "/", "-np", str(parallel), "-c", str(parallel * ctx_per_slot),
            "--no-webui", "--no-warmup", *([] if own_cache else ["--cache-ram", "0"]),
            *(["-t", str(threads)] if threads else []),
            # no repacked (AMX) weight buffers: their kernels crash llama-server at its first decode on VMs that
            # report AMX but do not grant it (seen here: exit -11 while loading); the same as the in-pod engine
            "--no-repack", *extra_args,
        ]
        # --api-key: from a private file (never on a command line others can read), kept for restarts
        self._key_dir = tempfile.mkdtemp(prefix="kvstash-llama-key-") if api_key else None
        if self._key_dir is not None:
            key_file = Path(self._key_dir) / "api-key"
            key_file.write_text(api_key + "\n")
            key_file.chmod(0o600)
            self.args += ["--api-key-file", str(key_file)]
        self.log_path = log_path or slot_dir / "llama-server.log"
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        self._launch()
        wait_healthy(self.url, START_TIMEOUT_S, self._proc)
        self._watcher = threading.Thread(target=self._watch, name="kvstash-llama-server-watch", daemon=True)
        self._watcher.start()

    def _launch(self) -> None:
        with self._lock, self.log_path.open("ab") as logf:
            # a session of its own: a signal to the sidecar's process group (Ctrl-C, `kill -- -PGID`) reaches the
            # sidecar alone, which drains and only then stops llama-server (runtime.drain); it still dies with it
            self._proc = subprocess.Popen(self.args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=_die_with_parent, start_new_session=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            proc = self._proc
            if proc is not None and proc.poll() is not None and not self._stopping.is_set():
                log.warning("llama-server exited with code %s; restarting it (its slots start empty)", proc.returncode)
                self.restarts += 1
                self._launch()
                try:
                    wait_healthy(self.url, START_TIMEOUT_S, self._proc)
                except ConfigError as exc:
                    log.error("llama-server restart failed: %s", exc)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)
