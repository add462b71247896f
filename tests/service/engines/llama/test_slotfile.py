"""llama-server slot files <-> tokens and KV: a hand-built golden file, hostile bytes, and llama-server's own files
(saved by a real llama-server, parsed, re-assembled byte for byte, restored and reused)."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from ops.llamaserver_build import binary_path
from service.engines.llama import llamastate, slotfile, statewrite
from service.engines.llama.llamaserverproc import LlamaServerProcess
from service.engines.llama.llamastate import StateGeometry
from service.engines.llama.models import resolve_gguf
from service.engines.llama.slotfile import SlotFileError
from tests.support import server_completion

GEO = StateGeometry(num_layers=2, kv_heads=2, head_dim=3, v_trans=False)
TOKENS = [1, 502, 77, 9]


def _kv(n: int) -> np.ndarray:
    """[2, 2, 2, n, 3] with values that name their place, so a misplaced one shows."""
    grid = np.arange(2 * 2 * 2 * n * 3, dtype=np.float32).reshape(2, 2, 2, n, 3)
    return grid.astype(np.float16)


def _golden(tokens: list[int], kv: np.ndarray, token_words: list[int] | None = None) -> bytes:
    """A slot file written field by field from the layout table in slotfile's docstring."""
    words = token_words if token_words is not None else [-1, 1, len(tokens), *tokens, 0]
    state = bytes(statewrite.assemble_state(kv, GEO))[8:]  # without the magic + seq_id prefix
    return struct.pack("<III", 0x67677371, 3, len(words)) + struct.pack(f"<{len(words)}i", *words) + state


def test_golden_file_parses_and_reassembles_bit_identically(tmp_path: Path) -> None:
    data = _golden(TOKENS, _kv(4))
    saved = slotfile.parse(data, GEO)
    assert saved.tokens == TOKENS and np.array_equal(saved.kv, _kv(4))
    assert b"".join(bytes(p) for p in slotfile.assemble(TOKENS, _kv(4), GEO)) == data
    size = slotfile.write(tmp_path / "s.bin", TOKENS, _kv(4), GEO)
    assert (tmp_path / "s.bin").read_bytes() == data and size == len(data)
    assert slotfile.facts(data).num_layers == 2


def test_the_kv_of_the_later_tokens_is_read_alone(tmp_path: Path) -> None:
    """What a hit's write-back needs: every token, the KV from `start` on, and kv_from saying so."""
    data = _golden(TOKENS, _kv(4))
    (tmp_path / "s.bin").write_bytes(data)
    for start in (0, 1, 3, 4, 9):
        saved = slotfile.read(tmp_path / "s.bin", GEO, start)
        assert saved.tokens == TOKENS and saved.kv_from == min(start, 4), start
        assert np.array_equal(saved.kv, _kv(4)[:, :, :, min(start, 4):]), start


def test_a_slot_file_of_the_first_cells_of_a_lent_state_is_written_from_its_rows(tmp_path: Path) -> None:
    """A hit landed in a state of 6 cells (a context lent) restores its first 4 as the very file `assemble` writes."""
    made = statewrite.state_view(6, GEO, into=bytearray(llamastate.state_size(6, GEO)))
    assert made is not None
    state, view = made
    view[...] = np.concatenate([_kv(4), np.full((2, 2, 2, 2, 3), 9.0, dtype=np.float16)], axis=3)
    pieces = slotfile.from_state(TOKENS, state, 6, GEO)
    assert slotfile.write_pieces(tmp_path / "s.bin", pieces) == len(_golden(TOKENS, _kv(4)))
    assert (tmp_path / "s.bin").read_bytes() == _golden(TOKENS, _kv(4))


def test_a_plain_token_list_of_older_servers_is_read() -> None:
    assert slotfile.parse(_golden(TOKENS, _kv(4), token_words=TOKENS), GEO).tokens == TOKENS


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d[:10], "slot file"),
        (lambda d: struct.pack("<I", 0x67677372) + d[4:], "magic"),
        (lambda d: d[:4] + struct.pack("<I", 2) + d[8:], "version"),
        (lambda d: d[:8] + struct.pack("<I", 10**6) + d[12:], "truncated"),
        (lambda d: d[:-1], "truncated"),
        (lambda d: d + b"\0\0\0\0", "unexpected bytes"),
    ],
)
def test_hostile_bytes_are_refused(mutate: object, message: str) -> None:
    data = _golden(TOKENS, _kv(4))
    with pytest.raises(llamastate.StateLayoutError, match=message):
        slotfile.parse(mutate(data), GEO)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("words", "message"),
    [
        ([-1, 2, 4, *TOKENS, 0], "version"),
        ([-1, 1, 5, *TOKENS, 0], "tokens in"),
        ([-1, 1, 4, *TOKENS, 1], "media"),
        ([-1, 1, 3, *TOKENS[:3], 0], "holds KV of 4"),
    ],
)
def test_token_lists_that_do_not_fit_are_refused(words: list[int], message: str) -> None:
    with pytest.raises(SlotFileError, match=message):
        slotfile.parse(_golden(TOKENS, _kv(4), token_words=words), GEO)
    with pytest.raises(SlotFileError, match=message):  # asking for none of the KV checks the lengths all the same
        slotfile.parse(_golden(TOKENS, _kv(4), token_words=words), GEO, start=len(TOKENS))


# -- llama-server's own files --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerProcess]:
    binary = binary_path()
    if binary is None:
        pytest.skip("no llama-server built: run `make setup`")
    slots = tmp_path_factory.mktemp("slots")
    proc = LlamaServerProcess(resolve_gguf("smollm2"), slots, parallel=1, ctx_per_slot=2048, threads=1, binary=binary)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def _tokens(url: str, text: str) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"content": text, "add_special": False, "parse_special": False})
    return [int(t) for t in r.json()["tokens"]]


def test_llama_servers_own_file_round_trips_and_restores(server: LlamaServerProcess) -> None:
    """A file llama-server saved parses, re-assembles to the same bytes; a prefix of it, written by kvstash,
    restores and llama-server then processes only the tokens after it."""
    url, slot_dir = server.url, Path(server.args[server.args.index("--slot-save-path") + 1])
    llama = httpx.Client(base_url=url, timeout=120)
    prompt = _tokens(url, "The quick brown fox jumps over the lazy dog. " * 6)
    first = server_completion(llama.post, prompt, id_slot=0)
    assert httpx.post(url + "/slots/0?action=save", json={"filename": "own.bin"}).status_code == 200
    data = (slot_dir / "own.bin").read_bytes()
    facts = slotfile.facts(data)
    geo = StateGeometry(30, 3, 64, facts.v_trans, facts.n_stream)  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    saved = slotfile.parse(data, geo)
    assert saved.tokens[: len(prompt)] == prompt and saved.kv.shape == (30, 2, 3, len(saved.tokens), 64)
    assert b"".join(bytes(p) for p in slotfile.assemble(saved.tokens, saved.kv, geo)) == data

    keep = len(prompt) - 5
    slotfile.write(slot_dir / "prefix.bin", prompt[:keep], saved.kv[:, :, :, :keep], geo)
    assert httpx.post(url + "/slots/0?action=erase").status_code == 200
    r = httpx.post(url + "/slots/0?action=restore", json={"filename": "prefix.bin"})
    assert r.status_code == 200 and r.json()["n_restored"] == keep, r.text
    again = server_completion(llama.post, prompt, id_slot=0)
    timings = again["timings"]
    assert isinstance(timings, dict) and (timings["cache_n"], timings["prompt_n"]) == (keep, 5)
    assert again["content"] == first["content"]
    llama.close()
