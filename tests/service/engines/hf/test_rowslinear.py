"""A batched decoding step's linear layers on a CPU: the weight times the rows, the same products as `linear`."""

from __future__ import annotations

import torch
from torch.nn import functional

from service.engines.hf.rowslinear import ROWS, use_row_products


def test_a_step_of_a_few_rows_gets_the_products_of_linear_and_anything_else_is_linear_itself() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 48, bias=False))
    use_row_products(model)
    for shape in [(1, 1, 64), (2, 1, 64), (3, 1, 64), (4, 1, 64), (5, 1, 64), (1, 7, 64), (2, 3, 64), (6, 64)]:
        x = torch.randn(shape)
        expected = functional.linear(functional.linear(x, model[0].weight, model[0].bias), model[1].weight)
        got = model(x)
        assert got.shape == expected.shape
        if len(shape) == 3 and shape[1] == 1 and shape[0] in ROWS:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            weight, bias = model[0].weight, model[0].bias  # the step's form itself: the weight times the rows
            assert torch.equal(model[0](x)[:, 0], torch.mm(weight, x[:, 0].contiguous().t()).t() + bias)
        else:
            assert torch.equal(got, expected)
    rows = torch.randn(64, 3).t().unsqueeze(1)  # [3, 1, 64], not contiguous: as a layer's output can be
    torch.testing.assert_close(model(rows), functional.linear(functional.linear(rows, model[0].weight, model[0].bias),
                                                              model[1].weight), rtol=1e-5, atol=1e-5)
