"""The codec on numpy alone, as `pip install kvstash` runs it (no torch imported here): every golden frame decodes to
its golden bits, a frame only a retired codec wrote is refused as retired, and numpy arrays round trip in every mode.
`make lowest` runs this file on the lowest versions of the core's dependencies pyproject.toml allows."""

from __future__ import annotations

import numpy as np
import pytest

from cachestore.codec import Codec
from cachestore.errors import RetiredFrame
from tests.paths import GOLDEN

DECODED = sorted(p.stem for p in GOLDEN.glob("*.decoded"))
ONLY_FRAMES = sorted(p.stem for p in GOLDEN.glob("*.frame") if not (GOLDEN / f"{p.stem}.decoded").exists())



@pytest.mark.parametrize("name", DECODED)
def test_a_golden_frame_decodes_to_its_bits_on_numpy(name: str) -> None:
    frame = (GOLDEN / f"{name}.frame").read_bytes()
    decoded = Codec("exact").decode(frame)
    assert isinstance(decoded, np.ndarray)
    assert np.ascontiguousarray(decoded).tobytes() == (GOLDEN / f"{name}.decoded").read_bytes()


@pytest.mark.parametrize("name", ONLY_FRAMES)
def test_a_frame_of_a_retired_codec_is_refused_as_retired(name: str) -> None:
    with pytest.raises(RetiredFrame):
        Codec("exact").decode((GOLDEN / f"{name}.frame").read_bytes())


@pytest.mark.parametrize("spec", ["exact", "fp16", "int8", "q8", "int4", "int2", "int4+zstd/kbits/s8",
                                  "int2+zstd:16/rotv/clip/outk/symv/s8"])
def test_numpy_kv_round_trips_in_every_mode(spec: str) -> None:
    rng = np.random.default_rng(7)
    kv = rng.standard_normal((3, 2, 2, 32, 64)).astype(np.float16)  # [layers, K/V, heads, tokens, head_dim]
    codec = Codec(spec)
    out = codec.decode(codec.encode(kv))
    assert isinstance(out, np.ndarray) and out.shape == kv.shape and out.dtype == kv.dtype
    err = np.abs(out.astype(np.float32) - kv.astype(np.float32)).mean()
    bound = {"exact": 0.0, "fp16": 0.0, "int8": 0.02, "q8": 0.02, "int4": 0.2}.get(spec.split("+")[0], 0.6)
    assert err <= bound, (spec, err)
