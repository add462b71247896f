"""Start and stop `kvstash sidecar --spawn` processes (each with its own llama-server) for the demo, the
benchmarks and the tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ops.pods import PodProcess
from ops.redisproc import free_port

# llama-server's log line for each request: "prompt eval time =  12.3 ms /  15 tokens (...)"
PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


@dataclass
class SidecarProcess(PodProcess):
    """One `kvstash sidecar --spawn` subprocess; its llama-server logs into `slot_dir`."""

    parallel: int = 2
    threads: int = 1
    slot_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvstash-sidecar-")))
    module: str = "ops.cli"  # what `python -m` runs: the command line (tests run it where torch cannot be imported)
    python: str = sys.executable  # the interpreter (ops/wheelcheck.py: a fresh venv's, with kvstash from a wheel)

    def start(self) -> SidecarProcess:
        self.port = self.port or free_port()
        args = [self.python, "-m", self.module, "sidecar", "--spawn", "--model", self.model,
                "--port", str(self.port), "--redis-url", self.redis_url, "--pod-name", self.name,
                "--log-level", "warning",
                "--slot-dir", str(self.slot_dir), "--parallel", str(self.parallel), "--threads", str(self.threads),
                *self.extra_args]
        if self.no_cache:
            args.append("--no-cache")
        fd, log = tempfile.mkstemp(prefix=f"kvstash-{self.name}-", suffix=".log")
        self.log_path = Path(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(args, stdout=fd, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        os.close(fd)
        return self

    def prompt_evals(self) -> list[int]:
        """Prompt tokens llama-server itself reports having processed, one entry per request, oldest first."""
        log = self.slot_dir / "llama-server.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        return [int(n) for n in PROMPT_EVAL.findall(text)]

    def cleanup(self) -> None:
        super().cleanup()
        for path in self.slot_dir.glob("*"):
            path.unlink(missing_ok=True)
        self.slot_dir.rmdir()


@dataclass
class LlamaServerPod(PodProcess):
    """A stock llama-server as a pod, no kvstash beside it: its own host-memory prompt cache (`--cache-ram`) left at
    llama-server's default. The sticky-sessions fleet of `kvstash bench fleet --engine llama-server`."""

    parallel: int = 4
    threads: int = 1
    ctx_per_slot: int = 4096
    ready_path = "/health"

    def start(self) -> LlamaServerPod:
        from service.engines.llama.llamaserverproc import DEFAULT_BINARY  # noqa: PLC0415
        from service.engines.llama.models import resolve_gguf  # noqa: PLC0415

        self.port = self.port or free_port()
        args = [str(DEFAULT_BINARY), "-m", str(resolve_gguf(self.model)), "--host", "127.0.0.1", "--port",
                str(self.port), "-np", str(self.parallel), "-c", str(self.parallel * self.ctx_per_slot),
                "--no-webui", "--no-warmup", "-t", str(self.threads), "--no-repack", *self.extra_args]
        fd, log = tempfile.mkstemp(prefix=f"kvstash-{self.name}-", suffix=".log")
        self.log_path = Path(log)
        self.proc = subprocess.Popen(args, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env}, start_new_session=True)
        os.close(fd)
        return self
