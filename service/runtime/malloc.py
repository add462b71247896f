"""glibc malloc settings for a pod: keep the memory a hit reads into paged in between requests.

A hit allocates its frames anew each time (redis-py's replies, hiredis's buffer, decompression), tens of MB on
the reader and rehydration threads. With glibc's defaults every thread gets an arena of its own, an arena's
64 MB sub-heaps are unmapped as soon as they empty, and blocks above the dynamic mmap threshold are mapped
and unmapped per allocation: so a large hit page-faults most of what it reads, every time, and on a VM each
fault costs microseconds. One arena, a fixed mmap threshold and a high trim threshold keep that memory mapped:
the process holds its peak heap instead of returning it.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the heap and are reused, never mapped anew
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept mapped before any is given back
TOP_PAD = 64 << 20  # the heap grows in steps this large

_applied: int | None = None


def tune(arenas: int) -> bool:
    """Limit glibc malloc to `arenas` arenas and keep freed memory mapped; False where it does not apply (0
    arenas: glibc's defaults; not glibc). Call it first thing in a process, before threads allocate: an
    arena limit is fixed once the process has more than 8 arenas. Repeated calls are no-ops."""
    global _applied
    if arenas <= 0 or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if _applied is not None:
        return _applied == arenas
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_ARENA_MAX, arenas), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                (M_TOP_PAD, TOP_PAD))
    if not all(mallopt(param, value) == 1 for param, value in settings):
        log.warning("glibc refused a malloc setting; running with its defaults for the rest")
        return False
    _applied = arenas
    log.debug("malloc: %d arena(s), mmap threshold %d MiB, trim threshold %d MiB", arenas,
              MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return True
