"""`kvstash sidecar` beside real llama-server processes: turns alternating two sidecars hit after the first, and
llama-server itself (its log) processed only the new tokens; replies equal one llama-server that restored the same
tokens from a local slot file; what goes wrong (a corrupt or refused slot file, a killed llama-server, a slot
directory llama-server does not write) is a miss or a refusal to start, never a wrong answer."""

from __future__ import annotations

import errno
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

from cachestore.errors import ConfigError
from ops.chatclient import stream_chat
from ops.llamaserver_build import binary_path
from ops.redisproc import RedisProcess
from ops.sidecar_cmd import sidecar_app
from ops.sidecarproc import SidecarProcess
from service.cache.pipeline import Pipeline
from service.engines import GenParams
from service.engines.generation import GenRequest
from service.engines.llama import slotfile
from service.engines.llama.llamaserver import LlamaServerEngine
from service.engines.llama.llamaserverproc import LlamaServerProcess, wait_healthy
from service.engines.llama.models import resolve_gguf
from service.settings import PodSettings
from tests.lentpod import rows_pod
from tests.paths import ROOT
from tests.support import cached_as_a_later_turn, cached_tokens, post_chat, resume_session, running, settle
from tests.timing import wait_for

ARGS = ("--codec", "exact", "--block-tokens", "16", "--ctx-per-slot", "4096")
SYSTEM = {"role": "system", "content": "You are a concise science tutor. Answer in two or three sentences."}
QUESTIONS = ["What is photosynthesis?", "Where in the cell does it happen?", "What gas does it release?",
             "Why does that matter for animals?"]
GREEDY = GenParams(max_tokens=32)

pytestmark = pytest.mark.skipif(binary_path() is None, reason="no llama-server built: run `make setup`")


# -- one engine in this process --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaServerEngine]:
    eng = LlamaServerEngine.spawn("smollm2", parallel=2, threads=1, ctx_per_slot=4096)
    try:
        yield eng
    finally:
        eng.close()


def _conversation(engine: LlamaServerEngine) -> tuple[list[int], list[int], Any]:
    """A first turn generated from scratch, and the prompt of the turn after it."""
    first = engine.chat_ids([SYSTEM, {"role": "user", "content": QUESTIONS[0]}])
    gen = engine.generate(GenRequest(first, None, GREEDY))
    second = engine.chat_ids([SYSTEM, {"role": "user", "content": QUESTIONS[0]},
                              {"role": "assistant", "content": gen.text}, {"role": "user", "content": QUESTIONS[1]}])
    return first, second, gen


async def test_a_llama_server_with_a_q8_0_cache_shares_it_exactly(
    engine: LlamaServerEngine, redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A llama-server run with `--cache-type-k/v q8_0` (and flash attention): the sidecar reads its slot files into
    float32, which q8 frames hold exactly, and restores a cached turn from them, which llama-server reuses; its blocks
    are named apart from an f16 server's. A pod's hit of q8 frames is received into the rows of the slot file's state
    (`_hit_lands_in_the_slot_state`)."""
    from cachestore.codec import Codec  # noqa: PLC0415

    q8 = LlamaServerEngine.spawn("smollm2", parallel=1, threads=1, ctx_per_slot=2048, kv_type="q8_0")
    try:
        assert q8.state_geometry.kv_type == 8 and q8.geometry.dtype == np.float32
        assert q8.fingerprint(64, "q8+lz4").short() != engine.fingerprint(64, "q8+lz4").short()
        first, second, gen = _conversation(q8)
        keep = len(first)
        codec = Codec("q8")
        kept = gen.kv[:, :, :, :keep]
        assert np.array_equal(codec.decode(codec.encode(kept)), kept)  # the cache's values exactly
        q8.forget()
        plain = q8.generate(GenRequest(second, None, GREEDY))
        q8.forget()
        hit = q8.generate(GenRequest(second, codec.decode(codec.encode(kept)), GREEDY))
        assert hit.cached_tokens == keep and q8.stats.restores == 1 and hit.token_ids and plain.token_ids
        await _hit_lands_in_the_slot_state(q8, redis_server, "q8", monkeypatch)
    finally:
        q8.close()


def test_a_spawned_llama_server_runs_the_flash_attention_asked_for() -> None:
    """`flash_attn="off"` spawns llama-server with `-fa off`: its slot files store V transposed, so the sidecar writes
    no token rows, and a cached turn still restores; a q8_0 cache refuses it before anything is spawned."""
    with pytest.raises(ConfigError, match="flash attention"):
        LlamaServerEngine.spawn("smollm2", parallel=1, threads=1, ctx_per_slot=2048, kv_type="q8_0", flash_attn="off")
    off = LlamaServerEngine.spawn("smollm2", parallel=1, threads=1, ctx_per_slot=2048, flash_attn="off")
    try:
        assert off.state_geometry.v_trans and not off.kv_layout.row_frames
        first, second, gen = _conversation(off)
        off.forget()
        hit = off.generate(GenRequest(second, gen.kv[:, :, :, :len(first)], GREEDY))
        assert hit.cached_tokens == len(first) and off.stats.restores == 1 and hit.token_ids
    finally:
        off.close()


async def test_a_hit_lands_in_the_state_of_the_slot_file_it_is_restored_from(
    engine: LlamaServerEngine, redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # flash attention on: V rows, frames as token rows
    assert engine.kv_layout.row_frames and not engine.kv_layout.rows_apart
    for codec in ("exact", "int8"):
        await _hit_lands_in_the_slot_state(engine, redis_server, codec, monkeypatch)


async def _hit_lands_in_the_slot_state(engine: LlamaServerEngine, redis_server: RedisProcess, codec: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod's hit lands in a context the sidecar lent: token rows (exact, q8) are received straight into the rows of
    a sequence state, anything else (int8) is dequantized into a view of it, and the slot file llama-server restores is
    written from that state, never assembled from a tensor. llama-server reuses every token, and the reply is the one
    a slot file assembled from the same KV gives. Every context comes back."""
    b = 16
    engine.forget()
    prompt = _conversation(engine)[1]
    full = engine.generate(GenRequest(prompt, None, GREEDY))
    async with rows_pod(engine, redis_server, codec, b) as (store, pipe):
        hashes = pipe.hashes(b"slot", prompt[:-1])
        frames = [pipe.codecs.at(i).encode(full.kv[:, :, :, i * b:(i + 1) * b]) for i in range(len(hashes))]
        assert (await store.store_blocks(pipe.model_key, hashes, frames)).value == len(hashes) >= 3
        hit = len(hashes) * b
        engine.forget()
        expected = engine.generate(GenRequest(prompt, _decoded(pipe, frames),
                                              GREEDY))  # a slot file assembled from a tensor
        assert expected.cached_tokens == hit
        engine.forget()
        view, _ = await pipe.lookup(b"slot", prompt)
        assert view.cached_tokens == hit and view.kv is not None and engine.is_lent(view.kv)
        assert (view.landing is None) == (codec != "int8")  # rows received in place; int8 lands, then dequantized
        if engine.kv_layout.rows_apart:
            view.kv.fill(float("nan"))  # the rows are in the state: nothing of the hit is read from the tensor

        def assembled(*_: object) -> None:
            raise AssertionError("a lent context's slot file was assembled from a tensor")

        restores = engine.stats.restores
        with monkeypatch.context() as m:
            m.setattr(slotfile, "assemble", assembled)
            gen = await pipe.generate(prompt, view, GREEDY)
        assert (gen.cached_tokens, engine.stats.restores) == (hit, restores + 1)
        assert gen.token_ids == expected.token_ids


def _decoded(pipe: Pipeline, frames: list[bytes]) -> np.ndarray:
    """The KV a pod's frames hold, as a plain array (no context lent)."""
    return np.concatenate([pipe.codecs.at(i).decode(f) for i, f in enumerate(frames)], axis=3)


def test_a_slot_dir_llama_server_does_not_write_is_refused_at_start(engine: LlamaServerEngine, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot share KV with kvstash"):
        LlamaServerEngine(engine.url, tmp_path, "smollm2")


def test_cached_kv_is_restored_and_llama_server_reuses_it(engine: LlamaServerEngine) -> None:
    first, second, gen = _conversation(engine)
    assert gen.seq_ids[: len(first)] == first and gen.kv.shape[3] == len(gen.seq_ids)
    keep = len(first)
    engine.forget()
    plain = engine.generate(GenRequest(second, None, GREEDY))
    engine.forget()
    before = engine.stats.restores
    hit = engine.generate(GenRequest(second, gen.kv[:, :, :, :keep], GREEDY))
    assert (hit.cached_tokens, engine.stats.restores) == (keep, before + 1)
    assert plain.cached_tokens == 0 and hit.token_ids and plain.token_ids


def test_a_corrupt_slot_file_is_a_miss_and_leaves_no_trace(engine: LlamaServerEngine,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A truncated file (llama-server refuses it): the request prefills, replies as with no cache at all, and the
    next restore works (upstream once corrupted later completions after a failed restore)."""
    first, second, gen = _conversation(engine)
    engine.forget()
    plain = engine.generate(GenRequest(second, None, GREEDY))
    engine.forget()
    honest = slotfile.assemble
    monkeypatch.setattr(slotfile, "assemble", lambda *a: [*honest(*a)[:2], honest(*a)[2][:-4096]])
    failures = engine.stats.restore_failures
    missed = engine.generate(GenRequest(second, gen.kv[:, :, :, : len(first)], GREEDY))
    assert engine.stats.restore_failures == failures + 1
    assert missed.cached_tokens == 0 and missed.text == plain.text
    monkeypatch.undo()
    engine.forget()
    again = engine.generate(GenRequest(second, gen.kv[:, :, :, : len(first)], GREEDY))
    assert again.cached_tokens == len(first) and again.token_ids


def test_a_refused_restore_is_a_miss(engine: LlamaServerEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token id outside the vocabulary in the file: llama-server refuses the restore."""
    first, second, gen = _conversation(engine)
    honest = slotfile.assemble
    monkeypatch.setattr(slotfile, "assemble", lambda tokens, kv, geo: honest([10**8, *tokens[1:]], kv, geo))
    engine.forget()
    failures = engine.stats.restore_failures
    missed = engine.generate(GenRequest(second, gen.kv[:, :, :, : len(first)], GREEDY))
    assert engine.stats.restore_failures == failures + 1 and missed.cached_tokens == 0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:  # not listening yet
        return False


def test_a_killed_llama_server_is_restarted_and_costs_a_miss(engine: LlamaServerEngine) -> None:
    first, second, gen = _conversation(engine)
    assert engine.process is not None and engine.process.pid is not None
    restarts = engine.process.restarts
    os.kill(engine.process.pid, signal.SIGKILL)
    process = engine.process
    wait_for(lambda: process.restarts != restarts and _healthy(engine.url), "llama-server restarted", 120, poll_s=0.2)
    after = engine.generate(GenRequest(second, None, GREEDY))  # its slots are empty: a full prefill
    assert after.cached_tokens == 0 and after.token_ids
    hit = engine.generate(GenRequest(second, gen.kv[:, :, :, : len(first)],
                                     GREEDY))  # a restore into the new server works
    assert hit.token_ids and hit.cached_tokens >= len(first)


def test_concurrent_requests_never_share_a_slot(engine: LlamaServerEngine) -> None:
    """Three requests at once on two slots: each saved slot holds exactly its own request's sequence (a slot
    handed to two requests would hold a mix, or llama-server would queue one behind the other's id_slot).
    Replies are not compared with solo runs: two sequences decoded together change llama.cpp's batch sizes."""
    prompts = [engine.chat_ids([SYSTEM, {"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    engine.forget()
    with ThreadPoolExecutor(3) as pool:
        gens = list(pool.map(lambda p: engine.generate(GenRequest(p, None, GREEDY)), prompts))
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.seq_ids == prompt + gen.token_ids[: len(gen.seq_ids) - len(prompt)] and gen.token_ids
        assert gen.kv.shape[3] == len(gen.seq_ids)


def test_a_full_slot_directory_is_a_miss(engine: LlamaServerEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second, gen = _conversation(engine)

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slotfile, "write_pieces", full)  # every slot file is written there
    engine.forget()
    failures = engine.stats.restore_failures
    missed = engine.generate(GenRequest(second, gen.kv[:, :, :, : len(first)], GREEDY))
    assert engine.stats.restore_failures == failures + 1 and missed.cached_tokens == 0 and missed.token_ids


def test_sidecar_app_in_front_of_a_running_llama_server(engine: LlamaServerEngine) -> None:
    """--upstream: a second engine on the same llama-server and slot directory, served by the sidecar's app."""
    upstream = LlamaServerEngine(engine.url, engine.slot_dir, "smollm2")
    try:
        settings = PodSettings(engine="llama-server", cache_enabled=False, parallel=upstream.parallel)
        with TestClient(sidecar_app(settings, upstream)) as client:
            body = {"model": "smollm2", "messages": [SYSTEM, {"role": "user", "content": QUESTIONS[0]}],
                    "max_tokens": 8}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
            assert 'kvstash_sidecar_events_total{event="restores"}' in client.get("/metrics").text
            assert client.get("/healthz").status_code == 200
    finally:
        upstream.close()


def test_an_upstream_restarted_underneath_is_noticed_and_costs_one_miss(tmp_path: Path) -> None:
    """--upstream: the engine does not supervise llama-server and believes slot 0 holds the conversation; after a
    restart llama-server prefills everything (counted as a reuse miss, the reply still right), and a restore into
    the new server works."""
    proc = LlamaServerProcess(resolve_gguf("smollm2"), tmp_path, parallel=1, ctx_per_slot=4096, threads=1)
    proc.start()
    upstream = LlamaServerEngine(proc.url, tmp_path, "smollm2")
    try:
        first, second, gen = _conversation(upstream)
        restarts = proc.restarts
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: proc.restarts != restarts, "the watcher noticing llama-server died", 30, poll_s=0.2)
        # the new llama-server refuses connections until it has bound its port: poll as the watcher does
        wait_healthy(proc.url, 120)
        misses = upstream.stats.reuse_misses
        after = upstream.generate(GenRequest(second, gen.kv[:, :, :, : len(first)], GREEDY))
        assert (after.cached_tokens, upstream.stats.reuse_misses) == (0, misses + 1) and after.token_ids
        upstream.forget()
        again = upstream.generate(GenRequest(second, gen.kv[:, :, :, : len(first)],
                                             GREEDY))  # restores into the new server
        assert again.cached_tokens == len(first) and again.token_ids
    finally:
        upstream.close()
        proc.stop()


# -- sidecar processes ----------------------------------------------------------------------------------------------
IDLE_RSS_LIMIT = 150 << 20  # a sidecar's own memory, idle (its llama-server's is the model's)


@pytest.fixture(scope="module")
def pods() -> Iterator[dict[str, SidecarProcess]]:
    """Three sidecars as an operator who installed only `kvstash[sidecar]` runs them: torch cannot be imported in
    their processes (tests.torchless_cli), so every test of them below also shows the sidecar needs none."""
    redis = RedisProcess().start()

    def torchless(name: str, no_cache: bool = False) -> SidecarProcess:
        return SidecarProcess(name, redis.url, "smollm2", ARGS, no_cache=no_cache, env={"PYTHONPATH": str(ROOT)},
                              module="tests.torchless_cli")

    try:
        with running({"a": torchless("side-a"), "b": torchless("side-b"), "plain": torchless("side-plain", True)},
                     ready_s=180) as procs:
            yield procs
    finally:
        redis.cleanup()


def _children(pid: int) -> set[int]:
    return {int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_killed_sidecar_takes_its_llama_server_with_it() -> None:
    """SIGKILL leaves the sidecar no time to stop its llama-server: the kernel kills it (PR_SET_PDEATHSIG), so no
    orphan keeps the port, the memory and a core's share."""
    redis = RedisProcess().start()
    side = SidecarProcess("side-killed", redis.url, "smollm2", ARGS)
    try:
        with running({"side": side}, ready_s=180):
            assert side.proc is not None
            (server,) = _children(side.proc.pid)
            assert _alive(server)
            side.kill()
            wait_for(lambda: not _alive(server), f"llama-server {server} gone with its sidecar", 10)
    finally:
        redis.cleanup()


_chat = partial(post_chat, model="smollm2", max_tokens=32, timeout_s=180)


def test_turns_alternate_sidecars_with_hits_and_only_new_tokens_processed(
    pods: dict[str, SidecarProcess], engine: LlamaServerEngine, figures: dict[str, object]
) -> None:
    """Every turn after the first hits on the other sidecar; llama-server's own log shows it processed only the
    tokens after what was restored; the reply is exactly that of one llama-server (`engine`, emptied each turn)
    that restored the same number of tokens of its own KV from a local slot file. Turns that differ from a sidecar
    with --no-cache (a full prefill: llama.cpp's batch-size numerics) are reported, never asserted away."""
    messages = [SYSTEM]
    previous_prompt, previous_kv, differs, rows = 0, None, [], []
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        pod = pods["a"] if turn % 2 == 0 else pods["b"]
        resp, plain = _chat(pod.url, messages), _chat(pods["plain"].url, messages)
        assert resp.status_code == 200 and plain.status_code == 200, resp.text
        reply = resp.json()["choices"][0]["message"]["content"]
        usage = resp.json()["usage"]
        cached = cached_as_a_later_turn(resp, turn, previous_prompt)
        prompt = engine.chat_ids(messages)
        assert usage["prompt_tokens"] == len(prompt)
        processed = pod.prompt_evals()[-1]  # llama-server's own count, from its log
        assert processed == len(prompt) - cached
        engine.forget()
        kept = previous_kv[:, :, :, :cached] if cached else None
        expected = engine.generate(GenRequest(prompt, kept, GenParams(max_tokens=32)))
        assert expected.cached_tokens == cached
        assert reply == expected.text, f"turn {turn}: the cache changed the reply"
        no_cache = plain.json()["choices"][0]["message"]["content"]
        assert pods["plain"].prompt_evals()[-1] == len(prompt)  # --no-cache: llama-server prefilled all
        if turn == 0:
            assert reply == no_cache
        elif reply != no_cache:
            differs.append({"turn": turn, "cached": reply, "no_cache": no_cache})
        rows.append({"turn": turn, "prompt": len(prompt), "cached": cached, "processed": processed})
        previous_prompt, previous_kv = len(prompt), expected.kv
        messages.append({"role": "assistant", "content": reply})
        settle(pod.url)
    figures["turns"] = rows
    figures["turns_differing_from_no_cache"] = differs
    print(json.dumps(rows))


def test_streamed_reply_equals_the_whole_one(pods: dict[str, SidecarProcess]) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name the planets of the solar system."}]
    whole = _chat(pods["a"].url, messages).json()["choices"][0]["message"]["content"]
    with httpx.Client(timeout=180) as client:
        # llama-server's defaults, not kvstash's: greedy only when asked for
        streamed = stream_chat(client, pods["b"].url, {"model": "smollm2", "messages": messages, "max_tokens": 32,
                                                       "temperature": 0})
    assert streamed.status == 200 and streamed.text == whole


def test_session_resumes_on_the_other_sidecar(pods: dict[str, SidecarProcess]) -> None:
    a, b = pods["a"], pods["b"]
    _, second = resume_session(a.url, b.url, "ls-1", [SYSTEM], QUESTIONS, max_tokens=24, timeout_s=180,
                               between=lambda: settle(a.url))
    assert b.prompt_evals()[-1] == second.json()["usage"]["prompt_tokens"] - cached_tokens(second)


def test_metrics_count_restores_and_no_unused_restore(pods: dict[str, SidecarProcess]) -> None:
    text = httpx.get(pods["b"].url + "/metrics").text
    events = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("kvstash_sidecar_events_total{")}
    assert events["restores"] >= 1 and events["reuse_misses"] == 0 and events["restore_failures"] == 0
    ready = httpx.get(pods["b"].url + "/readyz").json()
    assert (ready["engine"], ready["model"]) == ("llama-server", "smollm2")


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) << 10


def test_the_sidecars_run_without_torch_in_little_memory(pods: dict[str, SidecarProcess]) -> None:
    """Every conversation above ran through sidecars that cannot import torch; none has it mapped, and each holds
    under 150 MB while idle (what a sidecar container is sized by: llama-server's memory is the model's)."""
    for name, pod in pods.items():
        assert pod.proc is not None and pod.proc.poll() is None, pod.log_tail()
        maps = Path(f"/proc/{pod.proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps, name
        assert _rss(pod.proc.pid) < IDLE_RSS_LIMIT, (name, _rss(pod.proc.pid) >> 20)
