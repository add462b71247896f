"""llama.cpp's q8_0 rows: the layout of its KV cache at --cache-type-k/v q8_0 (per token and head, each 32 channels
an fp16 scale then 32 int8 codes), quantized and dequantized."""

from __future__ import annotations

import torch

F16 = torch.float16
Q8_BLOCK, Q8_BYTES = 32, 34


def q8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a multiple of 32, any float dtype) -> uint8 [..., D / 32 * 34]: llama.cpp's q8_0 blocks, each 32
    consecutive channels as an fp16 scale d = max|x| / 127 and 32 int8 codes round(x / d). Values that are q8_0 codes
    times their fp16 scale, held exactly (in fp32: a q8_0 cache parsed by `service.engines.llamastate`), come back as
    the very same bytes."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))  # [..., D / 32, 32]
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).to(F16)  # [..., D / 32, 1]
    wide = scale.float()
    codes = torch.where(wide > 0, blocks / wide, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    out = torch.empty((*blocks.shape[:-1], Q8_BYTES), dtype=torch.uint8, device=x.device)
    out[..., :2] = scale.view(torch.uint8)
    out[..., 2:] = codes.view(torch.uint8)
    return out.flatten(-2)


def q8_rows_into(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """out [..., D] (any float dtype, a strided view whose channels are contiguous is fine) = the q8_0 rows `rows`
    (uint8 [..., D / 32 * 34], `q8_rows`) dequantized: each code times its block's fp16 scale, exact in fp32."""
    blocks = rows.unflatten(-1, (-1, Q8_BYTES))  # [..., D / 32, 34]
    scale = blocks[..., :2].contiguous().view(F16).float()  # [..., D / 32, 1]
    codes = blocks[..., 2:].view(torch.int8)
    out.unflatten(-1, (-1, Q8_BLOCK)).copy_(codes.float().mul_(scale))
    return out
