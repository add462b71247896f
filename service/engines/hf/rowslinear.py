"""The linear layers of a batched decoding step on a CPU, as one weight-times-rows product.

A step of `hfcache.forward_rows` feeds each of its rows one token: every linear layer multiplies a few rows
[rows, 1, in] by its weight. On a CPU that step is bound by reading the weights, which the rows share, so two to five
rows should cost about what one does. The BLAS behind torch's `linear` (MKL) takes a slower path for two to five
rows on the AMD EPYC the project measures on; the same product written as the weight times the rows' transpose reads
the weights once at full speed (docs/engines-codecs.md has the timings). `use_row_products` gives a model's linear
layers that form for such steps; every other call (a prompt's tokens, one row) is `linear` as before. The rows'
results are those of another summation order, as they already were between one row and several.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional

ROWS = range(2, 6)  # rows of a step that take the weight-times-rows form: where it was measured to be faster


def use_row_products(model: torch.nn.Module) -> None:
    """Route `model`'s linear layers through `_linear` (on a CPU: elsewhere they stay as they are)."""
    if next(model.parameters()).device.type != "cpu":
        return
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = functools.partial(_linear, module)  # type: ignore[method-assign]


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 3 and x.shape[1] == 1 and x.shape[0] in ROWS:  # a batched decoding step: [rows, 1, in]
        # the rows as the columns of a column-major matrix (their contiguous copy, transposed): the fast form
        out = torch.mm(module.weight, x[:, 0].contiguous().t()).t().contiguous()
        if module.bias is not None:
            out += module.bias
        return out.unsqueeze(1)
    return functional.linear(x, module.weight, module.bias)
