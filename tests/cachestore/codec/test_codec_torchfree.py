"""The codec without torch, and torch and numpy giving the same bytes (golden cross tests).

A process in which torch cannot be imported (tests/torchfree.py) imports all of cachestore, encodes every mode from
numpy arrays, decodes, verifies and stores the frames; here torch encodes the same KV and decodes the same frames: the
frames are byte-identical and decode to the same bits, in every mode, the recommended int4/int2 specs included
(docs/codec-spec.md, cachestore/codec/names.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cachestore.codec import Codec
from cachestore.codec.arrays import to_host
from cachestore.codec.names import CHOICES, RECENT, spec_text
from cachestore.codec.rope import ADJACENT, HALVES, Rope
from ops.redisproc import RedisProcess
from tests.paths import ROOT

SHAPE = (4, 2, 2, 64, 64)  # [layers, 2, kv_heads, tokens, head_dim]: one block of a small model
ROPES = {HALVES: Rope(HALVES, tuple(10000.0 ** (-i / 32) for i in range(32))),
         ADJACENT: Rope(ADJACENT, tuple(500000.0 ** (-i / 32) for i in range(32)))}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _recommended() -> list[str]:
    """Every candidate of the codec plans (names.CHOICES), with layers one bit up where the candidate takes them."""
    specs = []
    for (mode, _), candidates in CHOICES.items():
        for options, key_share, value_share in candidates:
            specs.append(spec_text(options, mode, (1,) if key_share else (), (0, 2) if value_share else ()))
    return sorted(set(specs))


SPECS = sorted({
    "exact+none", "exact+lz4", "exact+zstd", "exact+lz4/rows", "fp16+none", "fp16+zstd", "fp16+lz4/rows",
    "int8+none", "int8+lz4", "int8+zstd", "q8+none", "q8+zstd",
    "int4", "int2", "int4+none/g64/plain", "int2+none/g64/plain", "int4+lz4/g32/rotv", "int2+zstd/g16/rotv/clip",
    "int4+none/outk/symv/s8/k5=3/v5=0.1", "int2+none/outk/symv/s8/k3=1/v3=2", "int2+none/kbits/symv/s8",
    "int4+none/kbits/s8", f"int4/recent={RECENT['int4']}", *_recommended(),
})


def _kv(dtype: str, tokens: int = SHAPE[3], seed: int = 0) -> torch.Tensor:
    """KV whose keys have channels of different scale (as a model's do), and a few repeated values (ties)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(*SHAPE[:3], tokens, SHAPE[4], generator=gen)
    kv[:, 0] *= torch.rand(SHAPE[0], SHAPE[2], 1, SHAPE[4], generator=gen) * 6 + 0.25
    kv[:, :, :, ::7] = kv[:, :, :, :1]  # equal tokens: equal value groups
    kv[..., 40:44] = kv[..., 0:4]  # equal channels: equal key widths and scores, ties an encoder must break alike
    return kv.to(DTYPES[dtype])


def _cases() -> list[dict[str, object]]:
    cases = []
    for dtype in DTYPES:
        for spec in SPECS:
            rope = ADJACENT if "/unrope" in spec and dtype == "float16" else HALVES if "/unrope" in spec else None
            cases.append({"name": f"{len(cases):03d}", "spec": spec, "dtype": dtype, "tokens": SHAPE[3],
                          "rope": [rope, list(ROPES[rope].inv_freq)] if rope else None})
    for spec in ("int4+none/g64/plain", "int2+none/g16/rotv/clip", "int8+none"):  # a partial block: padded groups
        cases.append({"name": f"{len(cases):03d}", "spec": spec, "dtype": "float32", "tokens": 37, "rope": None})
    return cases


def _torch_codec(case: dict[str, object]) -> Codec:
    rope = case["rope"]
    return Codec(str(case["spec"]), ROPES[rope[0]] if isinstance(rope, list) else None)


@pytest.fixture(scope="module")
def torchless(tmp_path_factory: pytest.TempPathFactory, shared_redis_server: RedisProcess) -> Path:
    """The probe's folder after a run without torch: each case's input, its frame and its decoded bytes."""
    folder = tmp_path_factory.mktemp("torchfree")
    cases = _cases()
    for case in cases:
        kv = _kv(str(case["dtype"]), int(str(case["tokens"])))
        bits = kv.view(torch.int16) if kv.dtype == torch.bfloat16 else kv
        np.save(folder / f"{case['name']}.npy", bits.numpy())
    (folder / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.torchfree", str(folder), shared_redis_server.url],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == f"torch-free: {len(cases)} cases"
    return folder


def test_the_library_imports_and_works_without_torch(torchless: Path) -> None:
    assert len(list(torchless.glob("*.frame"))) == len(_cases())


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c['spec']}-{c['dtype']}-{c['tokens']}")
def test_torch_and_numpy_make_the_same_frame_and_decode_it_alike(torchless: Path, case: dict[str, object]) -> None:
    kv = _kv(str(case["dtype"]), int(str(case["tokens"])))
    frame = _torch_codec(case).encode(kv)
    assert frame == (torchless / f"{case['name']}.frame").read_bytes()
    decoded = Codec().decode(frame, device="cpu")
    assert decoded.dtype == kv.dtype and decoded.shape == kv.shape
    assert to_host(decoded).tobytes() == (torchless / f"{case['name']}.decoded").read_bytes()


def test_decode_gives_numpy_unless_a_torch_device_is_named() -> None:
    frame = Codec("int8").encode(_kv("float32").numpy())
    assert isinstance(Codec().decode(frame), np.ndarray)
    assert isinstance(Codec().decode(frame, device="cpu"), torch.Tensor)
    assert isinstance(Codec().open(frame).decode_into(), np.ndarray)
    out = torch.zeros(SHAPE)
    assert Codec().decode_into(frame, out) is out and torch.equal(out, Codec().decode(frame, device="cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (run on a GPU machine)")
@pytest.mark.parametrize("spec", ["int8+lz4", "int4", "int2", *_recommended()])
def test_a_gpu_tensor_is_quantized_on_its_device_to_the_same_frame(spec: str) -> None:
    rope = ROPES[HALVES] if "/unrope" in spec else None
    kv = _kv("float16")
    frame = Codec(spec, rope).encode(kv.cuda())
    assert frame == Codec(spec, rope).encode(kv.numpy())
    out = torch.empty(SHAPE, dtype=torch.float16, device="cuda")
    Codec().decode_into(frame, out)
    assert torch.equal(out.cpu(), Codec().decode(frame, device="cpu"))
    assert Codec().decode(frame, device="cuda").device.type == "cuda"


@pytest.mark.parametrize("command", [["admin", "--help"], ["sidecar", "--help"], ["bench", "--help"],
                                     ["admin", "stats", "--help"]])
def test_the_command_line_answers_without_torch(command: list[str]) -> None:
    """What an operator without torch types first: the admin, sidecar and bench commands' help."""
    code = ("import sys; from tests import torchfree; torchfree.block(); from ops.cli import main; "
            f"sys.argv = ['kvstash', *{command!r}]; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: kvstash" in done.stdout
