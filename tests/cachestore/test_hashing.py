"""Chained prefix hashes: determinism, chaining, and identity separation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachestore.errors import ConfigError
from cachestore.hashing import ModelFingerprint, chain_hashes, encode_tokens, root_hash

FP = ModelFingerprint(
    model_id="test-model@rev1",
    tokenizer_digest="tok123",
    dtype="float32",
    num_layers=2,
    kv_heads=2,
    head_dim=16,
    block_tokens=4,
    codec="exact+none",
)
TOKENS = list(range(100, 110))

# Committed values: if these change, every cached block in every deployment misses.
GOLDEN_FP_DIGEST = "e68c762ecd7bd07200232c044bfefd9d"
GOLDEN_CHAIN = ["dc074b6ea3344eac1cbd462a4f3c2572", "7886ab65825657e5716a1720c512c6f9"]


def test_fingerprint_digest_is_pinned() -> None:
    assert FP.digest().hex() == GOLDEN_FP_DIGEST
    assert FP.short() == GOLDEN_FP_DIGEST[:16]


def test_chain_hashes_are_pinned() -> None:
    hashes = chain_hashes(TOKENS, FP.block_tokens, root_hash(FP, b"tenant-a"))
    assert [h.hex() for h in hashes] == GOLDEN_CHAIN


def test_only_full_blocks_are_hashed() -> None:
    root = root_hash(FP)
    assert len(chain_hashes(TOKENS[:3], 4, root)) == 0
    assert len(chain_hashes(TOKENS[:4], 4, root)) == 1
    assert len(chain_hashes(TOKENS[:9], 4, root)) == 2


def test_chain_depends_on_every_earlier_token() -> None:
    root = root_hash(FP)
    base = chain_hashes(TOKENS, 4, root)
    changed = chain_hashes([TOKENS[0] + 1, *TOKENS[1:]], 4, root)
    assert base[0] != changed[0] and base[1] != changed[1]
    later = chain_hashes([*TOKENS[:4], TOKENS[4] + 1, *TOKENS[5:]], 4, root)
    assert base[0] == later[0] and base[1] != later[1]


def test_tenant_and_model_separate_chains() -> None:
    a = chain_hashes(TOKENS, 4, root_hash(FP, b"tenant-a"))
    b = chain_hashes(TOKENS, 4, root_hash(FP, b"tenant-b"))
    other = ModelFingerprint(**{**FP.__dict__, "codec": "int8+lz4"})
    c = chain_hashes(TOKENS, 4, root_hash(other, b"tenant-a"))
    assert a[0] != b[0] and a[0] != c[0]


def test_same_hash_in_a_process_with_another_hash_seed() -> None:
    code = (
        "from cachestore.hashing import ModelFingerprint, chain_hashes, root_hash;"
        "fp = ModelFingerprint('test-model@rev1','tok123','float32',2,2,16,4,'exact+none');"
        f"print(','.join(h.hex() for h in chain_hashes({TOKENS!r}, 4, root_hash(fp, b'tenant-a'))))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    local = [h.hex() for h in chain_hashes(TOKENS, 4, root_hash(FP, b"tenant-a"))]
    assert out.stdout.strip().split(",") == local


def test_token_encoding_is_fixed_width_little_endian() -> None:
    assert encode_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    with pytest.raises(ValueError):
        encode_tokens([-1])
    with pytest.raises(ValueError):
        encode_tokens([2**32])


def test_fingerprint_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        ModelFingerprint("m", "t", "float32", 0, 1, 1, 1, "exact")
