"""A GGUF file's metadata values by key, read from its header without the gguf package's full parse.

llama.cpp's `llama_model_meta_val_str` leaves arrays out (LFM2's per-layer `attention.head_count_kv`, a
`sliding_window_pattern` of booleans), and `gguf.GGUFReader` takes ~8 s to index a 135M model's header (its
vocabulary). This reads the header once (GGUF v2/v3, little-endian: magic, u32 version, u64 tensor count,
u64 key count, then per key a u64-length string, u32 type and the value) and keeps only the keys asked for;
string arrays are skipped by their lengths.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from cachestore.errors import ConfigError

MetaValue = int | float | bool | str | list[int] | list[float] | list[bool] | list[str]

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 1 << 20


class _Stream:
    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh

    def read(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise ConfigError("GGUF header truncated")
        return data

    def unpack(self, fmt: str) -> int | float | bool:
        value: int | float | bool = struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]
        return value

    def string(self) -> str:
        return self.read(int(self.unpack("<Q"))).decode("utf-8", errors="replace")


def _value(s: _Stream, kind: int, keep: bool) -> MetaValue | None:
    if kind in _SCALARS:
        return s.unpack(_SCALARS[kind])
    if kind == _STRING:
        if keep:
            return s.string()
        s.fh.seek(int(s.unpack("<Q")), 1)
        return None
    if kind == _ARRAY:
        item, count = int(s.unpack("<I")), int(s.unpack("<Q"))
        if item in _SCALARS:
            raw = s.read(struct.calcsize(_SCALARS[item]) * count)
            return list(struct.unpack(f"<{count}{_SCALARS[item][1]}", raw)) if keep else None
        if item == _STRING:
            out = [_value(s, _STRING, keep) for _ in range(count)]
            return [str(v) for v in out] if keep else None
        raise ConfigError(f"GGUF array of type {item}")
    raise ConfigError(f"GGUF value of type {kind}")


def read_meta(path: Path, keys: Iterable[str]) -> dict[str, MetaValue]:
    """The values of those of `keys` the GGUF at `path` holds."""
    wanted = set(keys)
    found: dict[str, MetaValue] = {}
    with path.open("rb") as fh:
        s = _Stream(fh)
        if s.read(4) != b"GGUF":
            raise ConfigError(f"{path.name} is not a GGUF file")
        version = s.unpack("<I")
        if version not in (2, 3):
            raise ConfigError(f"{path.name}: GGUF version {version}")
        _tensors, n_keys = s.unpack("<Q"), int(s.unpack("<Q"))
        if n_keys > _MAX_KEYS:
            raise ConfigError(f"{path.name}: {n_keys} metadata keys")
        for _ in range(n_keys):
            key = s.string()
            value = _value(s, int(s.unpack("<I")), key in wanted)
            if key in wanted and value is not None:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found
