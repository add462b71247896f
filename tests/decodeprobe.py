"""Test helper (no tests): decode frames in a child process and report what each decode cost it.

The child measures what tracemalloc cannot see (torch's allocator, C extensions): the process's
peak resident memory during each decode (the kernel's VmHWM, reset before every frame through
/proc/self/clear_refs) and the CPU time the decode used, which, unlike wall time, a loaded machine
does not inflate. An address-space limit turns a runaway allocation into an error instead of
a machine that swaps. Run as `python -m tests.decodeprobe`; frames go in on stdin (u32 length +
bytes), one JSON line per frame comes back.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import dataclass
from types import TracebackType

from tests.paths import ROOT

HEADROOM_BYTES = 1 << 30  # address space the child may add after start-up before allocations fail


@dataclass(frozen=True)
class Outcome:
    status: str  # "decoded", "CodecError", or the name of any other exception (a failure)
    peak_bytes: int  # peak resident memory during the decode above what the process held before it
    cpu_s: float


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _serve() -> None:
    import resource  # noqa: PLC0415
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from cachestore.codec import Codec  # noqa: PLC0415
    from cachestore.errors import CodecError  # noqa: PLC0415

    torch.set_num_threads(1)  # CPU time of this thread is then the decode's whole cost
    decoder = Codec()
    decoder.decode(Codec("exact+none").encode(torch.zeros(1, 2, 1, 4, 8)), device="cpu")  # warm up every lazy import
    limit = _status_kb("VmSize") * 1024 + HEADROOM_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    read, write = sys.stdin.buffer, sys.stdout
    while header := read.read(4):
        data = read.read(struct.unpack("<I", header)[0])
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")  # reset VmHWM to the current resident size
        before = _status_kb("VmRSS")
        t0 = time.thread_time()
        try:
            out = decoder.decode(data, device="cpu")
            status = "decoded" if isinstance(out, torch.Tensor) and out.dim() == 5 else f"bad result {type(out)}"
            del out
        except CodecError:
            status = "CodecError"
        except BaseException as exc:  # noqa: BLE001 - reported, and the test fails on it
            status = type(exc).__name__
        cpu_s = time.thread_time() - t0
        peak = (_status_kb("VmHWM") - before) * 1024
        write.write(json.dumps({"status": status, "peak_bytes": peak, "cpu_s": cpu_s}) + "\n")
        write.flush()


class DecodeProbe:
    """A decoding child process; `decode(frame)` returns its Outcome. Use as a context manager."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.decodeprobe"], cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def decode(self, data: bytes) -> Outcome:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(struct.pack("<I", len(data)) + data)
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the decoding process died (exit {self._proc.wait()})")
        return Outcome(**json.loads(line))

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)

    def __enter__(self) -> DecodeProbe:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


if __name__ == "__main__":
    _serve()
