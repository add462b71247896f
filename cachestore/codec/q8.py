"""llama.cpp's q8_0 rows: the layout of its KV cache at --cache-type-k/v q8_0 (per token and head, each 32 channels
an fp16 scale then 32 int8 codes), quantized and dequantized (numpy arrays or torch tensors alike)."""

from __future__ import annotations

from cachestore.codec.arrays import Array, contiguous, device_of, dtype, namespace, round_clip

Q8_BLOCK, Q8_BYTES = 32, 34


def q8_rows(x: Array) -> Array:
    """x [..., D] (D a multiple of 32, any float dtype) -> uint8 [..., D / 32 * 34]: llama.cpp's q8_0 blocks, each 32
    consecutive channels as an fp16 scale d = max|x| / 127 and 32 int8 codes round(x / d). Values that are q8_0 codes
    times their fp16 scale, held exactly (in fp32: a q8_0 cache parsed by `service.engines.llamastate`), come back as
    the very same bytes."""
    xp = namespace(x)
    lead = tuple(x.shape[:-1])
    blocks = xp.reshape(xp.astype(x, xp.float32), (*lead, x.shape[-1] // Q8_BLOCK, Q8_BLOCK))  # [..., D / 32, 32]
    scale = xp.astype(xp.max(xp.abs(blocks), axis=-1, keepdims=True) / 127, xp.float16)  # [..., D / 32, 1]
    wide = xp.astype(scale, xp.float32)
    codes = xp.astype(round_clip(xp.where(wide > 0, blocks / xp.where(wide > 0, wide, 1.0), 0.0), -127, 127), xp.int8)
    out = xp.empty((*blocks.shape[:-1], Q8_BYTES), dtype=xp.uint8, device=device_of(x))
    out[..., :2] = scale.view(dtype(xp, "uint8"))
    out[..., 2:] = codes.view(dtype(xp, "uint8"))
    return xp.reshape(out, (*lead, out.shape[-2] * Q8_BYTES))


def q8_rows_into(out: Array, rows: Array) -> Array:
    """out [..., D] (any float dtype, a strided view whose channels are contiguous is fine) = the q8_0 rows `rows`
    (uint8 [..., D / 32 * 34], `q8_rows`) dequantized: each code times its block's fp16 scale, exact in fp32."""
    xp = namespace(out, rows)
    lead = tuple(rows.shape[:-1])
    blocks = xp.reshape(rows, (*lead, rows.shape[-1] // Q8_BYTES, Q8_BYTES))  # [..., D / 32, 34]
    scale = xp.astype(contiguous(blocks[..., :2]).view(dtype(xp, "float16")), xp.float32)  # [..., D / 32, 1]
    codes = xp.astype(blocks[..., 2:].view(dtype(xp, "int8")), xp.float32)
    codes *= scale
    out[...] = xp.reshape(codes, out.shape)
    return out

