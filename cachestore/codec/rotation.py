"""The block-Hadamard rotation of values (`/rotv`): an orthonormal, symmetric matrix along head_dim, its own inverse.

Blocks are Sylvester Hadamard matrices of the largest power of two dividing head_dim (at most 128): 64 -> one 64x64
block, 96 -> three 32x32 blocks, each scaled by 1 / sqrt(size). Applied as a fast Walsh-Hadamard transform (log2(size)
rounds of sums and differences, then the scale), not a matrix product: every library and device adds in the same
order, so numpy and torch rotate to the same bits (a BLAS product differs in its last bits between builds).
"""

from __future__ import annotations

import math

import numpy as np

from cachestore.codec import kernels
from cachestore.codec.arrays import Array, contiguous, is_torch, namespace, torch


def block_size(dim: int) -> int:
    """The Hadamard block size along a head of `dim` channels."""
    return min(dim & -dim, 128)


def rotate(x: Array) -> Array:
    """x [..., head_dim] (fp32) times the block-Hadamard matrix: rotates, and undoes a rotation. A new array."""
    xp = namespace(x)
    dim = x.shape[-1]
    size = block_size(dim)
    scale = 1.0 / math.sqrt(size)  # an fp32 scalar: every element rounded once more, alike everywhere
    blocks = contiguous(xp.reshape(xp.astype(x, xp.float32, copy=True), (-1, size)))  # [rows, size]
    if kernels.hadamard_rows(blocks, scale):  # on the cpu: one pass a row, in place
        return xp.reshape(blocks, x.shape)
    # elsewhere (a GPU): [size, rows], each block's channel c of every row side by side, so every round adds long
    # contiguous runs
    src = contiguous(xp.permute_dims(blocks, (1, 0)))
    rows = src.shape[1]
    dst = xp.empty_like(src)
    h = 1
    while h < size:
        a = xp.reshape(src, (size // (2 * h), 2, h * rows))  # each pair of channels h apart: (a, b) -> (a + b, a - b)
        b = xp.reshape(dst, a.shape)
        _add(a[:, 0], a[:, 1], b[:, 0])
        _sub(a[:, 0], a[:, 1], b[:, 1])
        src, dst = dst, src
        h *= 2
    src *= scale
    return xp.reshape(contiguous(xp.permute_dims(src, (1, 0))), x.shape)


def _add(a: Array, b: Array, out: Array) -> None:
    if is_torch(out):
        torch().add(a, b, out=out)
    else:
        np.add(a, b, out=out)


def _sub(a: Array, b: Array, out: Array) -> None:
    if is_torch(out):
        torch().sub(a, b, out=out)
    else:
        np.subtract(a, b, out=out)
