"""The hf engine's boundary-state format (service.engines.hf.boundarystate): a golden vector pins the bytes, a round
trip keeps every tensor, and every field of untrusted bytes is checked against the layout and the position before
anything is allocated."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from service.engines.hf.boundarystate import StateError, pack_state, state_problem, unpack_state
from service.engines.hf.layout import CONV, WINDOW, HfLayout, StateSlot

# two sliding layers of 1 KV head of width 2, window 4 (3 positions kept), a conv state of 2 x 3, full layer 3
LAYOUT = HfLayout("toy", 4, (3,), 1, 2, sliding=(0, 1), window=4, recurrent=(2,),
                  slots=(StateSlot(0, WINDOW, 0, (1, 2)), StateSlot(1, WINDOW, 0, (1, 2)),
                         StateSlot(2, CONV, 0, (2, 3))))


def _tensors(position: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    tokens = LAYOUT.window_tokens(position)
    return [torch.arange(4 * tokens, dtype=dtype).reshape(2, 1, tokens, 2) + 100 * i for i in range(2)] + [
        torch.arange(6, dtype=dtype).reshape(2, 3) - 3]


def _pack(position: int, dtype: torch.dtype = torch.float32) -> bytes:
    return pack_state(position, dtype, list(zip(LAYOUT.slots, _tensors(position, dtype), strict=True)))


def test_the_golden_vector() -> None:
    state = _pack(10)
    assert state[:12] == b"KVHS" + bytes([1, 1]) + struct.pack("<HI", 3, 10)
    assert state[12:36] == struct.pack("<HBBB3x4I", 0, WINDOW, 0, 4, 2, 1, 3, 2)
    assert len(state) == 12 + 3 * 24 + 4 * (12 + 12 + 6)
    assert hashlib.sha256(state).hexdigest()[:16] == "389e5cb32842beb5"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("position", [0, 2, 3, 10])
def test_a_round_trip_keeps_every_tensor(dtype: torch.dtype, position: int) -> None:
    state = _pack(position, dtype)
    assert state_problem(state, LAYOUT, position, dtype) is None
    for got, want in zip(unpack_state(state, LAYOUT, position, dtype), _tensors(position, dtype), strict=True):
        assert got.dtype == dtype and torch.equal(got, want)


def test_another_position_dtype_or_layout_is_named() -> None:
    state = _pack(10)
    assert state_problem(state, LAYOUT, 11, torch.float32) == "a state at position 10, the record is at 11"
    assert "dtype" in (state_problem(state, LAYOUT, 10, torch.float16) or "")
    wider = HfLayout("toy", 4, (3,), 1, 2, sliding=(0, 1), window=4, recurrent=(2,),
                     slots=(*LAYOUT.slots[:2], StateSlot(2, CONV, 0, (2, 4))))
    assert "slot 2: dims (2, 3), expected (2, 4)" == state_problem(state, wider, 10, torch.float32)
    longer = HfLayout("toy", 4, (3,), 1, 2, sliding=(0, 1), window=8, recurrent=(2,), slots=LAYOUT.slots)
    assert "slot 0: dims" in (state_problem(state, longer, 10, torch.float32) or "")
    moved = HfLayout("toy", 4, (3,), 1, 2, sliding=(0, 1), window=4, recurrent=(2,),
                     slots=(LAYOUT.slots[1], LAYOUT.slots[0], LAYOUT.slots[2]))
    assert "slot 0: layer 0" in (state_problem(state, moved, 10, torch.float32) or "")


def test_every_cut_and_every_flipped_header_byte_is_refused() -> None:
    state = _pack(10)
    header = 12 + 3 * 24
    for cut in range(len(state)):
        assert state_problem(state[:cut], LAYOUT, 10, torch.float32) is not None, cut
        with pytest.raises(StateError):
            unpack_state(state[:cut], LAYOUT, 10, torch.float32)
    assert state_problem(state + b"\0", LAYOUT, 10, torch.float32) is not None
    for at in range(header):
        flipped = state[:at] + bytes([state[at] ^ 0x01]) + state[at + 1:]
        assert state_problem(flipped, LAYOUT, 10, torch.float32) is not None, at


def test_huge_dims_are_refused_before_anything_is_allocated() -> None:
    state = bytearray(_pack(10))
    struct.pack_into("<4I", state, 12 + 2 * 24 + 8, 1 << 31, 1 << 31, 0, 0)  # the conv slot's dims
    assert "slot 2: dims" in (state_problem(bytes(state), LAYOUT, 10, torch.float32) or "")
