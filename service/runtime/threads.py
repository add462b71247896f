"""Which threads run torch on several cores: one, the thread that runs the model; every other thread one core.

torch's CPU ops run on libgomp, which gives each thread that starts a parallel region a team of its own.
Once the process has more OpenMP threads than cores, libgomp stops spinning between regions and parks
its workers instead, and every one of the hundreds of small regions of a forward step pays a futex wake-up:
a forward step becomes markedly slower, for good, as soon as a second thread has run one multi-threaded op
(SmolLM2 on 2 cores: by almost half). So the event loop, the rehydration threads and the
I/O threads keep torch to one core, and a single process-wide compute thread runs the model.

torch is not imported here: a process that runs no torch (the sidecar, llama.cpp's engines) never loads it, and the
thread settings apply only where some other module has imported it.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_TORCH_AT_START = sys.modules.get("torch")
_STARTED_WITH = int(_TORCH_AT_START.get_num_threads()) if _TORCH_AT_START is not None else 0


def compute_threads() -> int:
    """The cores the compute thread runs torch on: torch's own default as the process started (OMP_NUM_THREADS,
    else the physical cores), read from torch where it is loaded, else the cores this process may use."""
    if _STARTED_WITH:
        return _STARTED_WITH
    loaded = sys.modules.get("torch")
    if loaded is not None:  # loaded after this module: read on the thread that asks (never an I/O thread)
        return int(loaded.get_num_threads())
    return int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))


_lock = threading.Lock()
_compute: ThreadPoolExecutor | None = None


def one_core() -> None:
    """Keep torch ops started by the calling thread on one core (the setting is per thread); nothing where torch is
    not loaded."""
    _set_torch_threads(1)


def _set_torch_threads(n: int) -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)


def io_executor(workers: int, name: str) -> ThreadPoolExecutor:
    """Threads for work beside the model (decoding, encoding, copies, I/O): one core each."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=one_core)


def compute_executor(threads: int = 0) -> ThreadPoolExecutor:
    """The one thread of this process that runs torch models (shared, never shut down), on `threads` cores as
    the first call asks (0: `compute_threads`)."""
    global _compute
    with _lock:
        if _compute is None:
            _compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstash-compute",
                                          initializer=_set_torch_threads, initargs=(threads or compute_threads(),))
        return _compute


def on_compute_thread() -> bool:
    """Whether the calling thread is the compute thread (work submitted to it from there would wait forever)."""
    return threading.current_thread().name.startswith("kvstash-compute")
