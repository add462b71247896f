# The native module built from _kernels.c (see kernels.py, its only caller).
level: int

def int8(out: int, half: bool, codes: int, scales: int, shape: tuple[int, int, int, int],
         out_strides: tuple[int, ...], code_strides: tuple[int, ...], scale_strides: tuple[int, ...],
         threads: int) -> None: ...
def use(level: int) -> int: ...
def int4(out: int, half: bool, packed: int, scales: int, zeros: int, shape: tuple[int, int, int, int, int],
         out_strides: tuple[int, ...], code_strides: tuple[int, ...], scale_strides: tuple[int, ...],
         threads: int) -> None: ...
