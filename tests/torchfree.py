"""The library without torch, in a process of its own: `python -m tests.torchfree DIR [REDIS_URL]`.

torch is made unimportable before anything else is imported (a finder that refuses it and its submodules, as a
machine without it would: nothing of it in sys.modules), then every module of cachestore is imported, and each case
of DIR/cases.json (written by tests/cachestore/codec/test_codec_torchfree.py) is encoded from its numpy input
(DIR/NAME.npy, bfloat16 stored as its uint16 bits), decoded, verified, opened into a numpy output and, with
REDIS_URL, stored and fetched back through the block store. Writes DIR/NAME.frame and DIR/NAME.decoded (the decoded
array's bytes), and prints "torch-free: N cases" last.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType

BLOCKED = ("torch", "transformers", "accelerate", "safetensors")


class _Refuse(importlib.abc.MetaPathFinder):
    """Refuses torch and what would bring it in, as a machine without them would."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the library must work without it")


def block() -> None:
    assert not any(m.split(".")[0] in BLOCKED for m in sys.modules), "imported before the blocker"
    sys.meta_path.insert(0, _Refuse())


def main(argv: list[str]) -> int:
    block()
    try:
        import torch  # noqa: F401, PLC0415 - must fail: the blocker works
    except ImportError:
        pass
    else:
        raise AssertionError("torch imported past the blocker")
    import json  # noqa: PLC0415 - after the blocker, like everything else
    import pkgutil  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    import cachestore  # noqa: PLC0415

    for info in pkgutil.walk_packages(cachestore.__path__, "cachestore."):
        __import__(info.name)
    from cachestore.codec import Codec, FrameRun, verify_frame  # noqa: PLC0415
    from cachestore.codec.arrays import dtype  # noqa: PLC0415
    from cachestore.codec.rope import Rope  # noqa: PLC0415

    folder = Path(argv[0])
    cases = json.loads((folder / "cases.json").read_text())
    frames = []
    for case in cases:
        bits = np.load(folder / f"{case['name']}.npy")
        kv = bits.view(dtype(np, "bfloat16")) if case["dtype"] == "bfloat16" else bits
        rope = Rope(case["rope"][0], tuple(case["rope"][1])) if case["rope"] else None
        frame = Codec(case["spec"], rope).encode(kv)
        verify_frame(frame)
        out = Codec().decode(frame)
        assert isinstance(out, np.ndarray) and out.dtype == kv.dtype and out.shape == kv.shape, case
        wide = np.empty(kv.shape, dtype=np.float32)
        Codec().open(frame).decode_into(wide)
        if "/unrope" in case["spec"]:  # keys turned back after their dtype's rounding: within its steps of the largest
            steps = 2**-6 if case["dtype"] == "bfloat16" else 2**-9
            assert np.abs(wide - out.astype(np.float32)).max() <= steps * np.abs(wide).max(), case
        else:  # into fp32 alike, rounded once to its own dtype
            assert np.array_equal(wide.astype(out.dtype), out), case
        (folder / f"{case['name']}.frame").write_bytes(frame)
        (folder / f"{case['name']}.decoded").write_bytes(out.tobytes())
        frames.append(frame)
    _run_of_frames(Codec, FrameRun, cases, frames)
    if len(argv) > 1:
        _store_round_trip(argv[1], frames)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, f"loaded without being asked: {loaded}"
    print(f"torch-free: {len(cases)} cases")
    return 0


def _run_of_frames(codec: type, run: type, cases: list[dict[str, object]], frames: list[bytes]) -> None:
    """Frames of one int8 case laid side by side in one numpy buffer dequantize as a run, as a lookup's landing."""
    import numpy as np  # noqa: PLC0415

    at = next(i for i, c in enumerate(cases) if c["spec"] == "int8+none")
    frame = frames[at]
    landing = np.frombuffer(bytes(frame) * 3, dtype=np.uint8)
    opened = [codec().open(memoryview(landing)[k * len(frame):(k + 1) * len(frame)]) for k in range(3)]
    frames_run = run.of(landing, opened)
    assert frames_run is not None
    layers, _, heads, tokens, dim = opened[0].header.shape
    out = np.zeros((layers, 2, heads, 3 * tokens, dim), dtype=np.float32)
    frames_run.decode_into(out)
    one = codec().decode(frame).astype(np.float32)
    assert all(np.array_equal(out[:, :, :, k * tokens:(k + 1) * tokens], one) for k in range(3))


def _store_round_trip(url: str, frames: list[bytes]) -> None:
    from cachestore.hashing import ModelFingerprint, chain_hashes, root_hash  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415
    from cachestore.syncstore import SyncBlockStore  # noqa: PLC0415

    fp = ModelFingerprint("torchfree", "tok", "float32", 4, 2, 64, 16, "int8+lz4/g64")
    hashes = chain_hashes(list(range(16 * len(frames))), 16, root_hash(fp, b"tenant"))
    with SyncBlockStore(StoreSettings.from_url(url, namespace="torchfree")) as store:
        assert store.store_blocks(fp.short(), hashes, frames).value == len(frames)
        assert store.fetch(fp.short(), hashes).value == frames
        store.clear_namespace()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
