"""Golden codec frames: fixed inputs, their frames and decoded tensors, committed on purpose.

Format 1 frames (every case without an option, or /plain) were written before format 2 and must stay
byte-identical; format 2 holds rotated values (/rotv), format 5 the split layouts with 8-bit range codes (/outk,
/symv with /s8, some layers one bit more: /k5, /v5 in int4 frames, /k3, /v3 in int2), format 6 those with int2's key
channel classes (/kbits) or keys stored without their block's RoPE (/unrope, encoded by `golden_codec`), format 7
int4's key classes. The token-rows flag (/rows, format 1 or later) and mode q8 came later: an older reader refuses
the flag as unknown, and q8 by its unknown mode code. `RETIRED` frames were written by codecs kvstash no longer has
(formats 3 and 4, fp8, rotated keys, range codes without a split layout, int4's key classes of format 6): only their
.frame files stay, which a reader must refuse as retired. Write only new cases, deliberately (a changed format bumps
FORMAT_VERSION and keeps reading, or cleanly refuses, the old files):
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
    # format 2: rotated values (head_dim 12: three 4x4 Hadamard blocks)
    "int2_fp16_none_g8_rotv": ("int2+none/g8/rotv", torch.float16, (2, 2, 1, 9, 12)),
    # format 1 with FLAG_ROWS: payloads as token rows [layers, 2, tokens, kv_heads, head_dim] (a llama.cpp pod's)
    "fp16_fp16_none_rows": ("fp16+none/rows", torch.float16, (2, 2, 2, 3, 8)),
    "exact_fp32_lz4_rows": ("exact+lz4/rows", torch.float32, (1, 2, 2, 5, 4)),
    # mode q8 (code 7, always FLAG_ROWS): llama.cpp's q8_0 blocks of 32 channels, an fp16 scale and 32 int8 codes
    "q8_fp32_none": ("q8+none", torch.float32, (1, 2, 2, 3, 32)),
    "q8_fp16_lz4": ("q8+lz4", torch.float16, (2, 2, 1, 4, 64)),
    # format 5: outlier key channels and symmetric values with range codes, some layers one bit more (top bits apart);
    # rewritten when the encoder chose, among channels of equal width, the lowest first (torch.topk's order among
    # ties is its own, and numpy has none): the format is unchanged, the old frame decodes as it did
    "int2_fp32_none_g4_outk_symv_s8_k3": ("int2+none/g4/outk/symv/s8/k3=1/v3=0", torch.float32, (2, 2, 2, 10, 8)),
    # format 6: int2's key channel classes (0, 2, 3 or 4 bits; head_dim 64), and with keys stored without their RoPE
    "int2_fp32_none_g8_kbits_symv_s8": ("int2+none/g8/kbits/symv/s8", torch.float32, (2, 2, 1, 9, 64)),
    "int2_fp16_zstd_g8_kbits_unrope_v3": ("int2+zstd:3/g8/rotv/clip/kbits/symv/s8/unrope/v3=1", torch.float16,
                                          (2, 2, 2, 9, 64)),
    # format 7: int4's key channel classes (3 to 6 bits)
    "int4_fp32_none_g8_kbits7_s8": ("int4+none/g8/kbits/s8", torch.float32, (2, 2, 1, 9, 64)),
    "int4_fp16_zstd_g8_kbits7_unrope_v5": ("int4+zstd:3/g8/kbits/s8/unrope/v5=1", torch.float16, (2, 2, 2, 12, 64)),
    # format 1: the int8 frame of a partial last block under int4/int2+zstd/recent=int8
    # (tests/cachestore/codec/test_codec_recent.py)
    "int8_fp32_zstd_partial": ("int8+zstd:3", torch.float32, (2, 2, 1, 5, 8)),
}

# Frames of retired formats, by what made them retired (their .frame files only): a reader refuses each as retired.
RETIRED = {
    "fp8_fp32_none": "mode fp8",
    "int4_fp32_none_g4_rot_clip": "rotated keys (format 2)",
    "int4_bf16_lz4_g4_rotk": "rotated keys (format 2)",
    "int4_fp32_zstd_g4_k8v8": "layers at int8 (format 3)",
    "int2_fp16_none_g5_k8": "layers at int8 (format 3)",
    "int2_fp32_none_g4_k8k4v4": "layers at the other grouped precision (format 3)",
    "int4_fp16_zstd_g4_v2": "layers at the other grouped precision (format 3)",
    "int4_fp32_none_g4_k5v5": "layers one bit more without range codes (format 3)",
    "int2_fp16_zstd_g5_k3": "layers one bit more without range codes (format 3)",
    "int2_fp32_none_g4_outk_symv": "outlier keys and symmetric values without range codes (format 4)",
    "int4_fp16_zstd_g8_outk": "outlier keys without range codes (format 4)",
    "int2_bf16_lz4_g4_symv": "symmetric values without range codes (format 4)",
    "int4_fp32_none_g4_s8": "range codes without a split layout (format 5)",
    "int2_bf16_lz4_g4_rotv_clip_s8": "range codes without a split layout (format 5)",
    "int4_fp16_zstd_g8_s8_k8k5": "range codes without a split layout (format 5)",
    "int4_fp32_none_g8_kbits_s8": "int4 key classes of format 6",
    "int4_fp16_zstd_g8_kbits_unrope_v5": "int4 key classes of format 6",
}


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
        expected_path(name).write_bytes(tensor_bytes(Codec().decode(frame, device="cpu")))
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
