"""A pod's memory stays mapped between hits (service/runtime/malloc.py): one glibc arena, freed memory kept."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from cachestore.errors import ConfigError
from service.settings import MALLOC_ARENAS, malloc_arenas

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# What a lookup does to malloc: a reader thread of a pool receives ~100 MB of frames of 760 KB (8128 tokens,
# int8), another thread frees them; a round per lookup. Prints the page faults of the rounds after the first two.
HITS = textwrap.dedent("""
    import resource, sys
    from concurrent.futures import ThreadPoolExecutor
    from service.runtime import malloc
    tuned = malloc.tune(int(sys.argv[1]))
    readers = ThreadPoolExecutor(8)
    faults = []
    for round in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        frames = [readers.submit(lambda: [b"x" * 760_000 for _ in range(16)]) for _ in range(8)]
        frames = [f.result() for f in frames]
        del frames
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(tuned, sum(faults[2:]))
""")
PAGES_PER_ROUND = 8 * 16 * 760_000 // 4096


def _faults(arenas: int) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", HITS, str(arenas)], capture_output=True, text=True, check=True,
                         timeout=120)
    tuned, faults = out.stdout.split()
    return tuned, int(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc malloc only")
def test_one_arena_reads_lookup_after_lookup_into_memory_already_mapped() -> None:
    tuned, faults = _faults(MALLOC_ARENAS)
    assert tuned == "True"
    assert faults < 0.05 * 8 * PAGES_PER_ROUND, faults  # 8 rounds: almost nothing faulted again
    untuned, before = _faults(0)  # glibc's defaults: an arena per thread, emptied heaps unmapped
    assert untuned == "False"
    assert before > 10 * max(faults, 1), (before, faults)  # the measure can tell the two apart


def test_malloc_arenas_setting() -> None:
    assert malloc_arenas({}) == MALLOC_ARENAS == 1
    assert malloc_arenas({"KVSTASH_MALLOC_ARENAS": "0"}) == 0
    assert malloc_arenas({"KVSTASH_MALLOC_ARENAS": "4"}) == 4
    for bad in ("two", "-1"):
        with pytest.raises(ConfigError, match="KVSTASH_MALLOC_ARENAS"):
            malloc_arenas({"KVSTASH_MALLOC_ARENAS": bad})


def test_a_bad_malloc_setting_is_a_one_line_error_and_exit_2() -> None:
    out = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "codec", "--help"], capture_output=True,
                         text=True, env={"KVSTASH_MALLOC_ARENAS": "many", "PATH": ""}, timeout=120)
    assert out.returncode == 0  # --help ends before any setting is read
    out = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", "tiny-random"], capture_output=True,
                         text=True, env={"KVSTASH_MALLOC_ARENAS": "many", "PATH": ""}, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "kvstash: error: KVSTASH_MALLOC_ARENAS must be an int, got 'many'"
