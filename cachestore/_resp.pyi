# The native module built from _resp.c (see landing.py, its only caller).

from collections.abc import Callable

def receive(fd: int, timeout: float, buffer: bytearray, pos: int, end: int,
            plans: list[tuple[memoryview, ...] | None], filled: list[Callable[[memoryview], None] | None],
            first: int, stop: int) -> tuple[int, int, int, int, int]: ...
