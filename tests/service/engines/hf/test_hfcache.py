"""The transformers cache adapter: tensor <-> DynamicCache round trips and continued forwards."""

from __future__ import annotations

import pytest
import torch

from service.engines.hf import hfcache
from service.engines.hf.models import LoadedModel, load_model

IDS = list(range(200, 260))  # 60 arbitrary token ids


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def _full(tiny: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        logits, cache = hfcache.forward(tiny.model, IDS, None, all_logits=True)
        return logits, hfcache.tensor_from_cache(cache)


def test_transformers_takes_the_cache_as_cache(tiny: LoadedModel) -> None:
    assert hfcache.cache_arg(tiny.model) == "cache"


def test_tensor_cache_round_trip(tiny: LoadedModel) -> None:
    _, kv = _full(tiny)
    assert kv.shape == (2, 2, 2, len(IDS), 16)  # [layers, 2, kv_heads, tokens, head_dim]
    assert kv.is_contiguous() and kv.device.type == "cpu" and kv.dtype == torch.float32
    cache = hfcache.cache_from_tensor(kv, tiny.model)
    assert hfcache.cache_length(cache) == len(IDS)
    assert torch.equal(hfcache.tensor_from_cache(cache), kv)
    part = hfcache.tensor_from_cache(cache, 10, 25)
    assert part.is_contiguous() and torch.equal(part, kv[:, :, :, 10:25])


def test_empty_tensor_gives_empty_cache(tiny: LoadedModel) -> None:
    cache = hfcache.cache_from_tensor(torch.zeros(2, 2, 2, 0, 16), tiny.model)
    assert hfcache.cache_length(cache) == 0


@pytest.mark.parametrize("split", [1, 16, 32, 59])
def test_forward_on_rebuilt_cache_matches_full_forward(tiny: LoadedModel, split: int) -> None:
    full_logits, kv = _full(tiny)
    with torch.inference_mode():
        cache = hfcache.cache_from_tensor(kv[:, :, :, :split], tiny.model)
        logits, cache = hfcache.forward(tiny.model, IDS[split:], cache, all_logits=True)
        grown = hfcache.tensor_from_cache(cache)
    assert logits.shape == (len(IDS) - split, full_logits.shape[1])
    torch.testing.assert_close(logits, full_logits[split:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grown, kv, rtol=1e-5, atol=1e-5)


def test_forward_returns_last_logits_by_default(tiny: LoadedModel) -> None:
    full_logits, _ = _full(tiny)
    with torch.inference_mode():
        logits, cache = hfcache.forward(tiny.model, IDS, None)
    assert logits.shape == (1, full_logits.shape[1])
    torch.testing.assert_close(logits[0], full_logits[-1], rtol=1e-5, atol=1e-5)
    assert hfcache.cache_length(cache) == len(IDS)


def test_half_precision_kv_is_cast_to_the_model_dtype(tiny: LoadedModel) -> None:
    _, kv = _full(tiny)
    cache = hfcache.cache_from_tensor(kv.half(), tiny.model)
    assert cache.layers[0].keys.dtype == torch.float32


def test_bad_inputs_are_rejected(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError):
        hfcache.cache_from_tensor(torch.zeros(2, 2, 4, 16), tiny.model)  # 4-D
    with pytest.raises(ValueError):
        hfcache.cache_from_tensor(torch.zeros(3, 2, 2, 4, 16), tiny.model)  # wrong layer count
    _, kv = _full(tiny)
    cache = hfcache.cache_from_tensor(kv, tiny.model)
    with pytest.raises(ValueError):
        hfcache.tensor_from_cache(cache, 0, len(IDS) + 1)
    with pytest.raises(ValueError):
        hfcache.forward(tiny.model, [], cache)


@pytest.mark.parametrize("spare", [1, 3, 40])
def test_context_with_spare_capacity_grows_in_place(tiny: LoadedModel, spare: int) -> None:
    """A context decoded into a larger buffer is appended to in place, and the logits do not change,
    also when generation runs past the buffer's end (it then moves to a bigger one)."""
    ids = list(range(300, 340))
    with torch.inference_mode():
        _, full = hfcache.forward(tiny.model, ids[:30], None)
        kv = hfcache.tensor_from_cache(full)  # [L, 2, H, 30, D]
        buf = torch.zeros((*kv.shape[:3], 30 + spare, kv.shape[4]))
        buf[:, :, :, :30] = kv
        grown = hfcache.cache_from_tensor(buf[:, :, :, :30], tiny.model)
        plain = hfcache.cache_from_tensor(kv.clone(), tiny.model)
        assert isinstance(grown.layers[0], hfcache.GrowingLayer)
        assert not isinstance(plain.layers[0], hfcache.GrowingLayer)
        for token in ids[30:]:
            a, grown = hfcache.forward(tiny.model, [token], grown)
            b, plain = hfcache.forward(tiny.model, [token], plain)
            assert torch.equal(a, b)
        assert hfcache.cache_length(grown) == 40
        assert torch.equal(hfcache.tensor_from_cache(grown), hfcache.tensor_from_cache(plain))
        if spare >= 10:  # still inside the buffer: written in place
            assert torch.equal(buf[:, :, :, :40], hfcache.tensor_from_cache(grown))
