"""llama.cpp sequence-state bytes <-> KV arrays (numpy: llama.cpp's engines run without torch): a hand-built golden
state, hostile bytes, the real llama.cpp."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from cachestore.codec.arrays import strides
from service.engines.llama import llamastate, statewrite
from service.engines.llama.llamastate import StateGeometry, StateLayoutError, parse_state
from service.engines.llama.statewrite import assemble_state

RNG = np.random.default_rng(0)


def _randn(*shape: int, seed: int | None = None) -> np.ndarray:
    return (np.random.default_rng(seed) if seed is not None else RNG).standard_normal(shape, dtype=np.float32)


def _golden(v_trans: bool, positions: list[int]) -> tuple[bytes, np.ndarray]:
    """A state written field by field from the layout table (2 layers, 2 kv heads, head_dim 3), and the
    tensor it must parse to. Values encode (layer, k/v, head, position, dim), so a misplaced one shows."""
    layers, heads, dim, n = 2, 2, 3, len(positions)
    value = lambda ly, kv, h, p, d: ly * 1000 + kv * 500 + h * 100 + p * 10 + d  # noqa: E731
    want = np.empty((layers, 2, heads, n, dim), dtype=np.float16)
    for ly, kv, h, p, d in np.ndindex(layers, 2, heads, n, dim):
        want[ly, kv, h, p, d] = value(ly, kv, h, p, d)
    out = struct.pack("<IiI", 0xAF143CD8, 7, 1) + struct.pack("<I", n)
    for p in positions:
        out += struct.pack("<iIi", p, 1, 7)
    out += struct.pack("<II", int(v_trans), layers)
    for ly in range(layers):
        out += struct.pack("<iQ", 1, heads * dim * 2)
        for p in positions:  # a row per cell: heads x dim
            out += np.array([value(ly, 0, h, p, d) for h in range(heads) for d in range(dim)], "<f2").tobytes()
    for ly in range(layers):
        if v_trans:
            out += struct.pack("<iII", 1, 2, heads * dim)
            for h in range(heads):
                for d in range(dim):  # a row per channel: one element per cell
                    out += np.array([value(ly, 1, h, p, d) for p in positions], "<f2").tobytes()
        else:
            out += struct.pack("<iQ", 1, heads * dim * 2)
            for p in positions:
                out += np.array([value(ly, 1, h, p, d) for h in range(heads) for d in range(dim)], "<f2").tobytes()
    return out, want


@pytest.mark.parametrize("v_trans", [True, False])
def test_golden_state_parses_and_reassembles_bit_identically(v_trans: bool) -> None:
    blob, want = _golden(v_trans, [0, 1, 2, 3])
    geo = StateGeometry(2, 2, 3, v_trans)
    kv = parse_state(blob, geo)
    assert kv.dtype == np.float16 and np.array_equal(kv, want)
    assert bytes(assemble_state(kv, geo, seq_id=7)) == blob
    assert llamastate.state_size(4, geo) == len(blob)


@pytest.mark.parametrize("n", [4, 37])
def test_a_state_lent_with_v_as_rows_is_assembled_once_v_is_put_in_place(n: int) -> None:
    """V stored transposed (no flash attention): no view has both layouts, but one with each layer's V viewed as rows
    in its own region, filled, then `transpose_v`, gives `assemble_state`'s very bytes (odd sizes: the kernel's
    edges); anything but that layout is refused."""
    geo = StateGeometry(2, 2, 3, True)
    assert statewrite.state_view(n, geo) is None
    want = _randn(2, 2, 2, n, 3).astype(np.float16)
    made = statewrite.state_view(n, geo, seq_id=7, into=bytearray(llamastate.state_size(n, geo) + 64), v_as_rows=True)
    assert made is not None
    buf, view = made
    view[...] = want
    assert np.array_equal(view, want)
    statewrite.transpose_v(buf, n, geo)
    assert bytes(buf[:llamastate.state_size(n, geo)]) == bytes(assemble_state(want, geo, seq_id=7))
    with pytest.raises(StateLayoutError):
        statewrite.transpose_v(buf, n, StateGeometry(2, 2, 3, False))


def test_cells_out_of_order_are_sorted_by_position() -> None:
    blob, want = _golden(True, [2, 0, 3, 1])
    assert np.array_equal(parse_state(blob, StateGeometry(2, 2, 3, True)), want)


@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4], [3, 0, 4, 2, 1]])
@pytest.mark.parametrize("v_trans", [True, False])
def test_a_range_of_positions_is_parsed_alone(positions: list[int], v_trans: bool) -> None:
    """What a hit's write-back needs (the tokens after the blocks it read) comes out without the rest, by position
    whatever the order of the cells; the whole state is still checked."""
    blob, want = _golden(v_trans, positions)
    geo = StateGeometry(2, 2, 3, v_trans)
    for start, end in ((0, None), (2, None), (1, 3), (4, 5), (5, None), (3, 99)):
        got = parse_state(blob, geo, start, end)
        assert np.array_equal(got, want[:, :, :, start:end]), (start, end)
    with pytest.raises(StateLayoutError, match="unexpected bytes"):
        parse_state(blob + b"\0", geo, start=4)
    assert parse_state(blob, geo, 5, cells=5).shape[3] == 0
    with pytest.raises(llamastate.CellCountError, match="holds KV of 5"):
        parse_state(blob, geo, 5, cells=6)  # a sequence the caller knows to be longer, even with nothing copied


@pytest.mark.parametrize("positions", [[0, 1, 1], [1, 2, 3], [0, 2, 5]])
def test_a_sequence_that_is_not_a_plain_prefix_is_refused(positions: list[int]) -> None:
    blob, _ = _golden(True, positions)
    with pytest.raises(StateLayoutError, match="positions"):
        parse_state(blob, StateGeometry(2, 2, 3, True))


def test_hostile_or_foreign_states_are_refused() -> None:
    blob, _ = _golden(True, [0, 1, 2])
    geo = StateGeometry(2, 2, 3, True)
    for cut in (0, 3, 11, 20, len(blob) // 2, len(blob) - 1):
        with pytest.raises(StateLayoutError):
            parse_state(blob[:cut], geo)
    with pytest.raises(StateLayoutError, match="unexpected bytes"):
        parse_state(blob + b"\0", geo)
    with pytest.raises(StateLayoutError, match="magic"):
        parse_state(b"\0" * 4 + blob[4:], geo)
    with pytest.raises(StateLayoutError, match="layers"):
        parse_state(blob, StateGeometry(3, 2, 3, True))
    with pytest.raises(StateLayoutError, match="v_trans"):
        parse_state(blob, StateGeometry(2, 2, 3, False))
    with pytest.raises(StateLayoutError, match="streams"):
        parse_state(blob, StateGeometry(2, 2, 3, True, n_stream=4))
    q8 = bytearray(blob)
    k_type_at = 16 + 12 * 3 + 8
    struct.pack_into("<i", q8, k_type_at, 8)  # GGML_TYPE_Q8_0: refused, never read as F16
    with pytest.raises(StateLayoutError, match="type 8"):
        parse_state(bytes(q8), geo)


def test_one_stream_of_many_holds_the_sequence() -> None:
    kv = _randn(2, 2, 2, 5, 3).astype(np.float16)
    geo = StateGeometry(2, 2, 3, True, n_stream=4)
    blob = assemble_state(kv, geo)
    assert struct.unpack_from("<II", blob, 8) == (4, 5)
    assert struct.unpack_from("<III", blob, len(blob) - 12) == (0, 0, 0)
    assert np.array_equal(parse_state(blob, geo), kv)
    assert llamastate.read_facts(blob) == llamastate.StateFacts(4, True, 2, 6)


def test_float32_kv_is_stored_as_f16() -> None:
    kv = _randn(2, 2, 2, 4, 3)
    geo = StateGeometry(2, 2, 3, False)
    assert np.array_equal(parse_state(assemble_state(kv, geo), geo), kv.astype(np.float16))


@pytest.mark.parametrize(("v_trans", "n_stream"), [(True, 1), (False, 1), (True, 2)])
def test_a_reused_dirty_buffer_holds_the_same_state_as_a_fresh_one(v_trans: bool, n_stream: int) -> None:
    geo = StateGeometry(num_layers=3, kv_heads=2, head_dim=4, v_trans=v_trans, n_stream=n_stream)
    kv = _randn(3, 2, 2, 5, 4, seed=7).astype(np.float16)
    fresh = assemble_state(kv, geo)
    size = llamastate.state_size(5, geo)
    dirty = bytearray(b"\xab" * (size + 100))  # an earlier, longer state's leftovers
    assert assemble_state(kv, geo, into=dirty) is dirty
    assert bytes(dirty[:size]) == bytes(fresh)
    assert np.array_equal(parse_state(bytes(dirty[:size]), geo), kv)
    with pytest.raises(StateLayoutError, match="needs"):
        assemble_state(kv, geo, into=bytearray(size - 1))


@pytest.mark.parametrize(("positions", "n_stream"), [([0, 1, 2, 3], 1), ([0], 2), (list(range(9)), 3)])
def test_a_state_view_filled_with_kv_is_the_golden_state(positions: list[int], n_stream: int) -> None:
    """state_view writes every byte but K and V into a dirty buffer; its view, filled, makes the golden state
    (seq_id 7, the empty streams after): the same bytes assemble_state writes."""
    blob, want = _golden(False, positions)
    if n_stream > 1:  # the context's other streams follow, with no cells
        blob = blob[:8] + struct.pack("<I", n_stream) + blob[12:] + bytes(4 * (n_stream - 1))
    geo = StateGeometry(2, 2, 3, False, n_stream)
    dirty = bytearray(b"\xab" * (len(blob) + 64))
    made = statewrite.state_view(len(positions), geo, seq_id=7, into=dirty)
    assert made is not None
    buf, kv = made
    assert buf is dirty and kv.shape == want.shape and kv.dtype == np.float16
    assert strides(kv) == statewrite.state_view_strides(len(positions), geo)
    kv[...] = want
    assert bytes(buf[:len(blob)]) == blob == bytes(assemble_state(want, geo, seq_id=7))
    assert np.array_equal(parse_state(blob, geo), want)


def test_no_state_view_where_v_is_transposed_or_the_buffer_is_short() -> None:
    assert statewrite.state_view(4, StateGeometry(2, 2, 3, True)) is None
    geo = StateGeometry(2, 2, 3, False)
    with pytest.raises(StateLayoutError, match="needs"):
        statewrite.state_view(4, geo, into=bytearray(llamastate.state_size(4, geo) - 1))


@pytest.mark.parametrize(("n", "start", "count", "n_stream"), [(9, 0, 9, 1), (9, 3, 4, 2), (5, 4, 1, 1)])
def test_row_pieces_are_where_a_token_rows_payload_goes(n: int, start: int, count: int, n_stream: int) -> None:
    """The pieces of cells [start, start + count) of a state, written in order with a token-rows frame's payload
    ([layers, 2, tokens, kv_heads, head_dim]), make the state of that KV: the bytes assemble_state writes."""
    geo = StateGeometry(3, 2, 4, False, n_stream)
    kv = _randn(3, 2, 2, n, 4).astype(np.float16)
    made = statewrite.state_view(n, geo, into=bytearray(llamastate.state_size(n, geo)))
    assert made is not None
    buf, view = made
    view[...] = kv
    view[:, :, :, start:start + count] = 0
    payload = np.ascontiguousarray(kv[:, :, :, start:start + count].swapaxes(2, 3)).tobytes()
    pieces = statewrite.row_pieces(buf, n, geo, start, count)
    assert len(pieces) == 2 * 3 and all(len(p) == count * 2 * 2 * 4 for p in pieces)
    at = 0
    for piece in pieces:
        piece[:] = payload[at:at + len(piece)]
        at += len(piece)
    assert at == len(payload) and bytes(buf) == bytes(assemble_state(kv, geo))


def test_no_row_pieces_where_v_is_transposed_or_past_the_cells() -> None:
    geo = StateGeometry(2, 2, 3, False)
    buf = bytearray(llamastate.state_size(4, geo))
    with pytest.raises(StateLayoutError, match="transposed"):
        statewrite.row_pieces(buf, 4, StateGeometry(2, 2, 3, True), 0, 4)
    with pytest.raises(StateLayoutError, match="cells"):
        statewrite.row_pieces(buf, 4, geo, 2, 3)


@pytest.mark.parametrize("kv_type", [llamastate.GGML_TYPE_F16, llamastate.GGML_TYPE_Q8_0])
@pytest.mark.parametrize(("n", "count", "n_stream"), [(9, 9, 1), (9, 4, 2), (5, 1, 1)])
def test_the_first_cells_of_a_state_are_written_from_its_own_bytes(kv_type: int, n: int, count: int,
                                                                   n_stream: int) -> None:
    """A state laid out for n cells (a context lent for a hit) gives the state of its first `count` cells as pieces:
    joined, the bytes assemble_state writes for their KV; its rows are the buffer's own, never copied."""
    geo = StateGeometry(3, 2, 32, False, n_stream, kv_type)
    kv = _randn(3, 2, 2, n, 32)
    buf = bytearray(b"\xab" * (llamastate.state_size(n, geo) + 64))
    if kv_type == llamastate.GGML_TYPE_F16:
        made = statewrite.state_view(n, geo, seq_id=3, into=buf)
        assert made is not None
        made[1][...] = kv
        kv = kv.astype(np.float16)
    else:
        statewrite.lay_out(buf, n, geo, seq_id=3)
        statewrite.write_q8_rows(buf, n, geo, 0, kv)
        kv = parse_state(bytes(assemble_state(kv, geo)), geo)  # the values a q8_0 state holds
    pieces = statewrite.state_pieces(buf, n, geo, count)
    assert b"".join(bytes(p) for p in pieces) == bytes(assemble_state(kv[:, :, :, :count], geo, seq_id=3))
    layer_0_k = pieces[3]
    assert isinstance(layer_0_k, memoryview) and len(layer_0_k) == 12 + count * geo.row_bytes
    before = bytes(buf)
    layer_0_k[12] ^= 0xFF  # a view of the buffer: the state itself changed
    assert sum(x != y for x, y in zip(before, bytes(buf), strict=True)) == 1


def test_no_first_cells_where_v_is_transposed_or_past_the_cells() -> None:
    geo = StateGeometry(2, 2, 3, False)
    buf = statewrite.lay_out(bytearray(llamastate.state_size(4, geo)), 4, geo)
    with pytest.raises(StateLayoutError, match="transposed"):
        statewrite.state_pieces(buf, 4, StateGeometry(2, 2, 3, True), 4)
    for count in (0, 5):
        with pytest.raises(StateLayoutError, match="first"):
            statewrite.state_pieces(buf, 4, geo, count)
