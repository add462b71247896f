"""Boundary records (cachestore.boundary): the byte layout pinned, and every malformed value refused."""

from __future__ import annotations

import struct

import pytest

from cachestore.boundary import BoundaryRecord, pack_boundary, unpack_boundary
from cachestore.errors import CodecError
from cachestore.hashing import BlockHash
from cachestore.keys import KEY_SHAPES, KeySpace

RECORD = BoundaryRecord(position=35, token_ids=[7, 8, 9], frame=b"F" * 10, state=b"S" * 5)


def test_a_record_round_trips_in_its_documented_layout() -> None:
    value = pack_boundary(RECORD)
    assert value[:24] == b"KVBD" + bytes([1, 0, 0, 0]) + struct.pack("<IIII", 3, 35, 10, 5)
    assert value[32:] == struct.pack("<3I", 7, 8, 9) + b"F" * 10 + b"S" * 5
    assert unpack_boundary(value) == RECORD
    at_block_end = BoundaryRecord(position=32, token_ids=[], frame=b"", state=b"S")
    assert unpack_boundary(pack_boundary(at_block_end)) == at_block_end


@pytest.mark.parametrize("record", [
    BoundaryRecord(2, [1, 2, 3], b"F", b"S"),  # fewer positions than tokens
    BoundaryRecord(3, [1, 2, 3], b"", b"S"),  # tokens without their KV
    BoundaryRecord(3, [], b"F", b"S"),  # KV without tokens
    BoundaryRecord(3, [1], b"F", b""),  # no state
])
def test_a_record_that_does_not_add_up_is_not_written(record: BoundaryRecord) -> None:
    with pytest.raises(CodecError):
        pack_boundary(record)


def test_every_malformed_value_is_refused() -> None:
    value = pack_boundary(RECORD)
    for bad in (value[:-1], value + b"\0", value[:31], b"KVTL" + value[4:], value[:4] + b"\2" + value[5:],
                value[:-1] + bytes([value[-1] ^ 1]), value[:16] + struct.pack("<I", 1 << 30) + value[20:]):
        with pytest.raises(CodecError):
            unpack_boundary(bad)


def test_the_key_of_a_record_is_a_tails_in_its_own_kind() -> None:
    keys = KeySpace("ns", 16)
    parent = BlockHash(bytes(range(16)))
    shard, key = keys.boundary("m" * 16, parent)
    assert key == f"ns:bnd:{'m' * 16}:{parent.hex()}:{{ns:s{shard:02d}}}"
    assert shard == keys.tail("m" * 16, parent)[0]
    assert "ns:bnd:*" in keys.entry_patterns()
    assert any(shape.pattern.startswith("<ns>:bnd:") for shape in KEY_SHAPES)
