"""Golden codec frames: fixed inputs, their frames and decoded tensors, committed on purpose.

Format 1 frames (every case without /rot, /k8 or /v8) were written before format 2 and must stay
byte-identical; format 2 added the rotated int4/int2 frames, format 3 those with int8 layers (/k8,
/v8), and later within format 3 tables giving layers the other grouped precision (/k4, /v4 in int2 frames,
/k2, /v2 in int4: an older format 3 reader refuses them for their table's bits); format 4 the frames with outlier
key channels or symmetric values (/outk, /symv); later within format 3, tables giving layers one bit more (/k5,
/v5 in int4 frames, /k3, /v3 in int2); format 5 the frames with 8-bit range codes (/s8); format 6 those with key
channel classes (/kbits) or keys stored without their block's RoPE (/unrope, encoded by `golden_codec`); format 7
int4's key classes in new counts, the format 6 int4 ones staying as `FORMER` cases. The
token-rows flag (/rows, format 1 or later) and mode q8 came later: an older reader refuses the flag as unknown, and
q8 by its unknown mode code. Write only new cases, deliberately (a changed format bumps FORMAT_VERSION and keeps
reading, or cleanly refuses, the old files):
    .venv/bin/python -m tests.golden.cases --write NAME [NAME ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent

# name -> (codec spec, dtype, [layers, 2, kv_heads, tokens, head_dim])
CASES: dict[str, tuple[str, torch.dtype, tuple[int, int, int, int, int]]] = {
    "exact_bf16_none": ("exact+none", torch.bfloat16, (2, 2, 1, 3, 4)),
    "exact_fp32_lz4": ("exact+lz4", torch.float32, (1, 2, 2, 32, 8)),
    "fp16_fp32_zstd": ("fp16+zstd:3", torch.float32, (1, 2, 1, 6, 8)),
    "int8_fp16_none": ("int8+none", torch.float16, (2, 2, 2, 5, 8)),
    "int8_fp32_lz4": ("int8+lz4", torch.float32, (1, 2, 2, 32, 8)),
    "int4_fp16_none_g4": ("int4+none/g4/plain", torch.float16, (1, 2, 2, 6, 8)),
    "int4_bf16_zstd_g8": ("int4+zstd:3/g8/plain", torch.bfloat16, (2, 2, 1, 9, 8)),
    "int2_fp32_none_g4": ("int2+none/g4/plain", torch.float32, (1, 2, 1, 10, 4)),
    "fp8_fp32_none": ("fp8+none", torch.float32, (1, 2, 2, 4, 8)),
    # format 2: rotated keys and values (head_dim 8, one 8x8 Hadamard block; 12: three 4x4 blocks)
    "int4_fp32_none_g4_rot_clip": ("int4+none/g4/rot/clip", torch.float32, (1, 2, 2, 6, 8)),
    "int2_fp16_none_g8_rotv": ("int2+none/g8/rotv", torch.float16, (2, 2, 1, 9, 12)),
    "int4_bf16_lz4_g4_rotk": ("int4+lz4/g4/rotk", torch.bfloat16, (1, 2, 2, 40, 8)),
    # format 3: a layer table keeping some layers' keys / values at int8 (int2 g5 head_dim 3: codes end mid-byte)
    "int4_fp32_zstd_g4_k8v8": ("int4+zstd:3/g4/plain/k8=1/v8=0.2", torch.float32, (3, 2, 2, 6, 8)),
    "int2_fp16_none_g5_k8": ("int2+none/g5/plain/k8=0", torch.float16, (2, 2, 1, 7, 3)),
    # format 3, later: tables that give layers the other grouped precision (int4 in int2 frames, int2 in int4)
    "int2_fp32_none_g4_k8k4v4": ("int2+none/g4/plain/k8=0/k4=1/v4=0.2", torch.float32, (3, 2, 2, 6, 8)),
    "int4_fp16_zstd_g4_v2": ("int4+zstd:3/g4/plain/v2=1", torch.float16, (2, 2, 1, 9, 8)),
    # format 1 with FLAG_ROWS: payloads as token rows [layers, 2, tokens, kv_heads, head_dim] (a llama.cpp pod's)
    "fp16_fp16_none_rows": ("fp16+none/rows", torch.float16, (2, 2, 2, 3, 8)),
    "exact_fp32_lz4_rows": ("exact+lz4/rows", torch.float32, (1, 2, 2, 5, 4)),
    # mode q8 (code 7, always FLAG_ROWS): llama.cpp's q8_0 blocks of 32 channels, an fp16 scale and 32 int8 codes
    "q8_fp32_none": ("q8+none", torch.float32, (1, 2, 2, 3, 32)),
    "q8_fp16_lz4": ("q8+lz4", torch.float16, (2, 2, 1, 4, 64)),
    # format 4: outlier key channels (/outk: 1 in 8 at int4 in int2, 1 in 16 at int8 in int4) and symmetric values
    "int2_fp32_none_g4_outk_symv": ("int2+none/g4/outk/symv", torch.float32, (2, 2, 2, 10, 8)),
    "int4_fp16_zstd_g8_outk": ("int4+zstd:3/g8/outk", torch.float16, (1, 2, 1, 9, 16)),
    "int2_bf16_lz4_g4_symv": ("int2+lz4/g4/clip/symv", torch.bfloat16, (1, 2, 2, 5, 8)),
    # format 3, later: tables giving layers one bit more (5 in int4 frames, 3 in int2; top bits in their own section)
    "int4_fp32_none_g4_k5v5": ("int4+none/g4/plain/k8=2/k5=0/v5=1.2", torch.float32, (3, 2, 2, 6, 8)),
    "int2_fp16_zstd_g5_k3": ("int2+zstd:3/g5/plain/k4=1/k3=0", torch.float16, (2, 2, 1, 7, 3)),
    # format 5: 8-bit range codes between each block's extremes (/s8), alone, with rotation and clipping, with a table
    "int4_fp32_none_g4_s8": ("int4+none/g4/s8", torch.float32, (2, 2, 2, 6, 8)),
    "int2_bf16_lz4_g4_rotv_clip_s8": ("int2+lz4/g4/rotv/clip/s8", torch.bfloat16, (1, 2, 2, 9, 8)),
    "int4_fp16_zstd_g8_s8_k8k5": ("int4+zstd:3/g8/s8/k8=1/v2=2/k5=0.2", torch.float16, (3, 2, 1, 9, 8)),
    # format 5 with outlier key channels and symmetric values, some layers one bit more (top bits apart)
    "int2_fp32_none_g4_outk_symv_s8_k3": ("int2+none/g4/outk/symv/s8/k3=1/v3=0", torch.float32, (2, 2, 2, 10, 8)),
    # format 6: key channel classes (int2 0, 2, 3 or 4 bits, int4 3 to 6; head_dim 64), and with keys stored without
    # their RoPE
    "int2_fp32_none_g8_kbits_symv_s8": ("int2+none/g8/kbits/symv/s8", torch.float32, (2, 2, 1, 9, 64)),
    "int4_fp32_none_g8_kbits_s8": ("int4+none/g8/kbits/s8", torch.float32, (2, 2, 1, 9, 64)),
    "int4_fp16_zstd_g8_kbits_unrope_v5": ("int4+zstd:3/g8/kbits/s8/unrope/v5=1", torch.float16, (2, 2, 2, 12, 64)),
    "int2_fp16_zstd_g8_kbits_unrope_v3": ("int2+zstd:3/g8/rotv/clip/kbits/symv/s8/unrope/v3=1", torch.float16,
                                          (2, 2, 2, 9, 64)),
    # format 7: int4's key channel classes in the counts of version 7 (the two int4 cases above are format 6's)
    "int4_fp32_none_g8_kbits7_s8": ("int4+none/g8/kbits/s8", torch.float32, (2, 2, 1, 9, 64)),
    "int4_fp16_zstd_g8_kbits7_unrope_v5": ("int4+zstd:3/g8/kbits/s8/unrope/v5=1", torch.float16, (2, 2, 2, 12, 64)),
    # format 1: the int8 frame of a partial last block under int4/int2+zstd/recent=int8 (tests/test_codec_recent.py)
    "int8_fp32_zstd_partial": ("int8+zstd:3", torch.float32, (2, 2, 1, 5, 8)),
}

# Frames of a format this encoder no longer writes for their spec (int4's key classes of version 6, written by the
# release before version 7): they must keep decoding to their tensor, and are not encoded again.
FORMER = frozenset({"int4_fp32_none_g8_kbits_s8", "int4_fp16_zstd_g8_kbits_unrope_v5"})


def golden_codec(spec: str) -> Any:
    """The encoder of a case: with `ROPE` where the spec stores keys without their RoPE."""
    from cachestore.codec import Codec  # noqa: PLC0415
    from cachestore.codec.rope import HALVES, Rope  # noqa: PLC0415

    return Codec(spec, Rope(HALVES, tuple(10000.0 ** (-i / 32) for i in range(32))) if "/unrope" in spec else None)


def make_input(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A fixed tensor built from integer arithmetic, exact in every dtype on every machine.

    Values are multiples of 1/16 in [-50/16, 50/16], times 1, 2 or 4 by channel, so keys
    have channels of different magnitude.
    """
    count = 1
    for size in shape:
        count *= size
    ints = (torch.arange(count, dtype=torch.int64) * 37) % 101 - 50
    channel = torch.arange(count, dtype=torch.int64) % shape[-1]
    values = ints.double() / 16 * (2.0 ** (channel % 3)).double()
    return values.view(shape).to(dtype)


def frame_path(name: str) -> Path:
    return HERE / f"{name}.frame"


def expected_path(name: str) -> Path:
    """Raw little-endian bits of the decoded tensor, in its dtype."""
    return HERE / f"{name}.decoded"


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def write(names: list[str]) -> None:
    from cachestore.codec import Codec  # noqa: PLC0415

    for name in names:
        spec, dtype, shape = CASES[name]
        frame = golden_codec(spec).encode(make_input(dtype, shape))
        frame_path(name).write_bytes(frame)
        expected_path(name).write_bytes(tensor_bytes(Codec().decode(frame)))
        print(f"wrote {name}: {len(frame)} bytes")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", nargs="+", metavar="NAME", choices=sorted(CASES),
                        help="(over)write the committed files of these cases")
    args = parser.parse_args()
    if args.write:
        write(args.write)
    else:
        parser.print_help()
