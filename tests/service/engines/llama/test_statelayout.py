"""The sections of llama.cpp sequence states (llama.statelayout), golden against what the pinned llama.cpp
writes for tiny full-attention, sliding-window and hybrid models (tests.tinymodels), and the layout each engine
names."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from service.engines.llama.ggufmeta import read_meta
from service.engines.llama.llamastate import MAGIC, StateLayoutError
from service.engines.llama.statelayout import (
    KV,
    RECURRENT,
    KvSection,
    ModelLayout,
    RecurrentSection,
    cut_kv,
    read_sections,
    sliding_layers,
)
from tests.tinymodels import converter_missing, tiny_gguf

llama_cpp = pytest.importorskip("llama_cpp")
needs_converter = pytest.mark.skipif(converter_missing() is not None, reason=converter_missing() or "")

TOKENS = 50  # more than the tiny models' window (32)
SEQ = 1  # the second of two sequences: its stream follows an empty one
F16, F32 = 1, 0


@contextmanager
def _context(path: Path, flash_attn: int = -1) -> Iterator[object]:
    """A llama.cpp context of two sequences (a stream each) of the model at `path`."""
    lib = llama_cpp
    lib.llama_backend_init()
    mparams = lib.llama_model_default_params()
    mparams.use_extra_bufts = False
    model = lib.llama_model_load_from_file(str(path).encode(), mparams)
    assert model, f"llama.cpp could not load {path}"
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 512, 64, 64, 2
    cparams.n_threads = cparams.n_threads_batch = 1
    cparams.kv_unified = False
    cparams.flash_attn_type = flash_attn
    ctx = lib.llama_init_from_model(model, cparams)
    try:
        yield ctx
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def _decode(ctx: object, positions: range) -> list[float]:
    """Decode token 100 + p at each position p into sequence SEQ, in one batch; the last position's logits."""
    lib = llama_cpp
    batch = lib.llama_batch_init(len(positions), 0, 2)
    try:
        batch.n_tokens = len(positions)
        for j, p in enumerate(positions):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = 100 + p, p, 1
            batch.seq_id[j][0], batch.logits[j] = SEQ, j == len(positions) - 1
        assert lib.llama_decode(ctx, batch) == 0
    finally:
        lib.llama_batch_free(batch)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(lib.llama_get_model(ctx)))
    return list(lib.llama_get_logits_ith(ctx, -1)[:n_vocab])


@contextmanager
def _decoded(path: Path, flash_attn: int = -1) -> Iterator[object]:
    """A context with TOKENS tokens decoded into sequence SEQ."""
    with _context(path, flash_attn) as ctx:
        _decode(ctx, range(TOKENS))
        yield ctx


def _state(ctx: object, partial: bool = False) -> bytes:
    flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
    size = llama_cpp.llama_state_seq_get_size_ext(ctx, SEQ, flags)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, SEQ, flags) == size
    return bytes(buf)


def _kv_bytes(cells: int, layers: int, row: int, n_stream: int = 2) -> int:
    """Bytes of a KV section: n_stream and a cell count per stream, the cells, v_trans and n_layer, then per layer
    K and V each behind a 12-byte header."""
    return 4 + 4 * n_stream + 12 * cells + 8 + 2 * layers * (12 + cells * row)


def _check_kv(section: object, start: int, positions: range, layers: int, row: int) -> None:
    assert isinstance(section, KvSection)
    assert (section.start, section.end) == (start, start + _kv_bytes(len(positions), layers, row))
    assert section.positions == tuple(positions) and section.n_stream == 2 and not section.v_trans
    assert [(r.ggml_type, r.row_bytes) for r in section.k + section.v] == [(F16, row)] * 2 * layers
    first_k = start + 4 + 8 + 12 * len(positions) + 8 + 12  # n_stream, 2 cell counts, cells, v_trans/n_layer, header
    assert [r.at for r in section.k] == [first_k + i * (12 + len(positions) * row) for i in range(layers)]


@needs_converter
def test_a_full_attention_state_is_one_kv_section_of_every_position() -> None:
    with _decoded(tiny_gguf("llama3-hd128")) as ctx:
        blob, partial = _state(ctx), _state(ctx, partial=True)
    (kv,) = read_sections(blob, [KV])
    _check_kv(kv, 8, range(TOKENS), layers=2, row=1 * 128 * 2)  # 1 KV head of 128 channels, f16
    assert len(blob) == 8 + _kv_bytes(TOKENS, 2, 256) == 51_876
    assert partial == blob  # a plain KV cache ignores PARTIAL_ONLY


@needs_converter
@pytest.mark.parametrize(("name", "full", "sliding", "row"), [
    ("gemma3", 1, 5, 1 * 32 * 2),  # layers 0-4 slide, 5 is global; 1 KV head of 32
    ("gpt-oss", 1, 1, 2 * 16 * 2),  # layer 0 slides, 1 is full; 2 KV heads of 16
])
def test_a_sliding_window_state_holds_every_position_then_the_last_window(name: str, full: int, sliding: int,
                                                                          row: int) -> None:
    with _decoded(tiny_gguf(name)) as ctx:
        blob, partial = _state(ctx), _state(ctx, partial=True)
    base, swa = read_sections(blob, [KV, KV])
    _check_kv(base, 8, range(TOKENS), full, row)
    window = range(TOKENS - 32, TOKENS)  # n_swa = 32: the cells with pos_max - pos < 32
    _check_kv(swa, base.end, window, sliding, row)
    assert len(blob) == 8 + _kv_bytes(TOKENS, full, row) + _kv_bytes(32, sliding, row)
    (swa_only,) = read_sections(partial, [KV])  # PARTIAL_ONLY: the SWA cache alone, byte for byte
    _check_kv(swa_only, 8, window, sliding, row)
    assert partial[8:] == blob[base.end:]


@needs_converter
def test_without_flash_attention_both_caches_keep_v_transposed() -> None:
    with _decoded(tiny_gguf("gemma3"), flash_attn=0) as ctx:
        base, swa = read_sections(_state(ctx), [KV, KV])
    assert base.v_trans and swa.v_trans and len(swa.positions) == 32
    assert [r.row_bytes for r in swa.v] == [64] * 5  # 32 channels of 2 bytes, one row per channel


@needs_converter
def test_a_hybrid_state_is_the_attention_kv_then_one_recurrent_state() -> None:
    with _decoded(tiny_gguf("lfm2")) as ctx:
        blob, partial = _state(ctx), _state(ctx, partial=True)
    kv, rec = read_sections(blob, [KV, RECURRENT])
    _check_kv(kv, 8, range(TOKENS), layers=2, row=2 * 16 * 2)  # layers 1 and 3 attend: 2 KV heads of 16
    assert isinstance(rec, RecurrentSection)
    assert rec.positions == (TOKENS - 1,) and rec.model_layers == 4  # one cell: everything up to the last position
    conv = (3 - 1) * 64 * 4  # the last l_cache - 1 inputs of 64 channels, f32
    assert [(r.ggml_type, r.row_bytes) for r in rec.r] == [(F32, conv)] * 2
    assert [(r.ggml_type, r.row_bytes) for r in rec.s] == [(F32, 0)] * 2  # short convolutions: no SSM state
    assert rec.state_bytes == 1_024 and (rec.start, rec.end) == (kv.end, len(blob))
    assert rec.r[0].at == kv.end + 4 + 8 + 8 + 12  # cell count, the cell (pos, n_seq_id = 0), s_trans, n_layer
    (alone,) = read_sections(partial, [RECURRENT])
    assert len(partial) == 8 + (rec.end - rec.start) == 1_100 and partial[8:] == blob[kv.end:]


@needs_converter
@pytest.mark.parametrize(("name", "kinds"), [
    ("llama3-hd128", [KV]), ("gemma3", [KV, KV]), ("gpt-oss", [KV, KV]), ("lfm2", [KV, RECURRENT]),
])
def test_a_state_of_a_cut_prefix_and_the_boundarys_window_resumes_exactly(name: str, kinds: list[str]) -> None:
    """What a boundary record makes possible: a later state's full-attention KV cut back to the boundary, with the
    window (or recurrent state) llama.cpp wrote at the boundary, is a state that goes on exactly as the sequence
    did: the next tokens' logits are bit for bit those of the sequence that never stopped."""
    boundary = 40
    with _context(tiny_gguf(name)) as ctx:
        _decode(ctx, range(boundary))
        at_boundary = _state(ctx, partial=True)  # SWA or recurrent sections alone (a full state where none)
        expected = _decode(ctx, range(boundary, TOKENS))
        later = _state(ctx)
    sections = read_sections(later, kinds)
    assert isinstance(sections[0], KvSection) and len(sections[0].positions) == TOKENS
    state = later[:8] + cut_kv(later, sections[0], boundary) + (at_boundary[8:] if len(kinds) > 1 else b"")
    assert [len(s.positions) for s in read_sections(state, kinds)] == [
        boundary, *([32] if kinds[1:] == [KV] else [1] if kinds[1:] else [])]
    with _context(tiny_gguf(name)) as ctx:
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        assert llama_cpp.llama_state_seq_set_data(ctx, buf, len(state), SEQ) == len(state)
        assert _decode(ctx, range(boundary, TOKENS)) == expected
    if kinds[1:] == [RECURRENT]:  # the control: the later recurrent state has folded those tokens in already
        stale = later[:8] + cut_kv(later, sections[0], boundary) + later[sections[1].start:]
        with _context(tiny_gguf(name)) as ctx:
            buf = (ctypes.c_uint8 * len(stale)).from_buffer_copy(stale)
            assert llama_cpp.llama_state_seq_set_data(ctx, buf, len(stale), SEQ) == len(stale)
            assert _decode(ctx, range(boundary, TOKENS)) != expected


def _kv_blob(positions: list[int], layers: int = 1, row: int = 4) -> bytes:
    out = struct.pack("<IiII", MAGIC, 0, 1, len(positions))
    out += b"".join(struct.pack("<iIi", p, 1, 0) for p in positions) + struct.pack("<II", 0, layers)
    return out + b"".join(struct.pack("<iQ", F16, row) + bytes(row * len(positions)) for _ in range(2 * layers))


def test_hostile_or_foreign_states_are_refused() -> None:
    good = _kv_blob([0, 1, 2])
    assert read_sections(good, [KV])[0].positions == (0, 1, 2)
    with pytest.raises(StateLayoutError, match="magic"):
        read_sections(b"\0" * 4 + good[4:], [KV])
    with pytest.raises(StateLayoutError, match="truncated"):
        read_sections(good[:-1], [KV])
    with pytest.raises(StateLayoutError, match="unexpected bytes"):
        read_sections(good + b"\0", [KV])
    with pytest.raises(StateLayoutError, match="truncated"):
        read_sections(good, [KV, RECURRENT])  # a hybrid's state lacks its recurrent part
    recurrent = struct.pack("<IiIII", 1, 9, 0, 0, 2)  # one cell at position 9, n_seq_id 0, s_trans 0, 2 layers
    rows = struct.pack("<iQ", F32, 4) + bytes(4)
    assert read_sections(good + recurrent + rows + rows, [KV, RECURRENT])[1].positions == (9,)
    with pytest.raises(StateLayoutError, match="not an R and an S"):
        read_sections(good + recurrent + rows, [KV, RECURRENT])
    with pytest.raises(StateLayoutError, match="2 cells"):
        read_sections(good + struct.pack("<I", 2) + recurrent[4:] + rows + rows, [KV, RECURRENT])


def test_which_layers_slide_follows_the_gguf_then_llama_cpps_default() -> None:
    assert sliding_layers("gemma3", 18, None) == tuple(il for il in range(18) if il % 6 != 5)
    assert sliding_layers("gpt-oss", 4, None) == (0, 2)
    assert sliding_layers("gemma3", 4, 2) == (0, 2)
    assert sliding_layers("whatever", 3, [True, False, True]) == (0, 2)
    assert sliding_layers("whatever", 3, None) is None


def test_a_layout_names_its_layers_in_the_fingerprint_and_in_one_line() -> None:
    full = ModelLayout("llama", 30, 30, kv_row_bytes=(384,) * 30)
    gemma = ModelLayout("gemma3", 6, 1, n_swa=32, sliding=(0, 1, 2, 3, 4), sliding_count=5, kv_row_bytes=(64,) * 6)
    wider = ModelLayout("gemma3", 6, 1, n_swa=64, sliding=(0, 1, 2, 3, 4), sliding_count=5, kv_row_bytes=(64,) * 6)
    assert full.tag() == ""  # full-attention fingerprints stay what they were
    assert gemma.tag() == "/layout:gemma3:6/swa32:0-4x5/rows:64,64,64,64,64,64" != wider.tag()
    assert gemma.describe() == "gemma3, 6 layers: 5 sliding-window (window 32; layers 0-4), 1 full-attention"


@needs_converter
@pytest.mark.parametrize(("name", "layout", "tag"), [
    ("gemma3", "gemma3, 6 layers: 5 sliding-window (window 32; layers 0-4), 1 full-attention",
     "/layout:gemma3:6/swa32:0-4x5/rows:64,64,64,64,64,64"),
    ("gpt-oss", "gpt-oss, 2 layers: 1 sliding-window (window 32; layer 0), 1 full-attention",
     "/layout:gpt-oss:2/swa32:0x1/rows:64,64"),
    ("lfm2", "lfm2, 4 layers: 2 recurrent (layers 0,2; 1,024 bytes of state a sequence), 2 full-attention",
     "/layout:lfm2:4/rec:0,2x2:1024B/rows:64,64"),
])
def test_the_llamacpp_engine_serves_a_sliding_or_hybrid_layout_naming_it(name: str, layout: str, tag: str) -> None:
    """Its blocks hold the full-attention layers alone (boundary records the rest), under a fingerprint naming the
    layout."""
    from service.engines.llama.llamacpp import LlamaCppEngine  # noqa: PLC0415

    engine = LlamaCppEngine(tiny_gguf(name), name=name, parallel=1, threads=1)
    try:
        assert engine.layout.describe() == layout and engine.layout.tag() == tag and engine.boundary_records
        assert engine.geometry.num_layers == engine.layout.full
        assert engine.fingerprint(16, "exact").num_layers == engine.layout.full
    finally:
        engine.close()


@needs_converter
def test_the_gguf_header_names_per_layer_arrays_llama_cpp_leaves_out() -> None:
    meta = read_meta(tiny_gguf("lfm2"), ["general.architecture", "lfm2.attention.head_count_kv", "absent"])
    assert meta == {"general.architecture": "lfm2", "lfm2.attention.head_count_kv": [0, 2, 0, 2]}
