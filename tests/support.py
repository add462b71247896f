"""Helpers the tests share (never in a test module): pods as processes, in-process pod clients, TLS servers, and the
codec's test inputs and error bounds."""

from __future__ import annotations

import shutil
import struct
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch
from starlette.testclient import TestClient

from ops.pods import PodProcess
from ops.redisproc import RedisProcess, RedisProcessError, free_port
from tests.timing import wait_for

# -- pods as processes --------------------------------------------------------------------

POD_ARGS = ("--codec", "exact", "--block-tokens", "16")


P = TypeVar("P", bound=Any)


def write_queue(pod: str | TestClient) -> int:
    """Background write jobs queued or being written on the pod (or sidecar) at a URL or in-process (/readyz counts
    the one in flight)."""
    readyz = httpx.get(pod + "/readyz", timeout=5) if isinstance(pod, str) else pod.get("/readyz")
    return int(readyz.json()["write_queue"])


def settle(pod: str | TestClient, timeout_s: float = 20.0) -> None:
    """Until the pod (or sidecar) at a URL or in-process has nothing queued or being written."""
    wait_for(lambda: not write_queue(pod), "the write queue to drain", timeout_s, poll_s=0.05)


@contextmanager
def running(procs: dict[str, P], ready_s: float = 120) -> Iterator[dict[str, P]]:
    """Start every process (pods, sidecars) at once, wait until each is ready, clean all of them up after."""
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready(ready_s)
        yield procs
    finally:
        for p in procs.values():
            p.cleanup()


def post_chat(url: str, messages: list[dict[str, Any]], *, model: str = "tiny-random", max_tokens: int = 10,
              timeout_s: float = 60.0, **extra: Any) -> httpx.Response:
    """A greedy chat completion POSTed to the pod or sidecar at `url`; `extra` are body fields."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout_s)


def cached_as_a_later_turn(resp: Any, turn: int, previous_prompt: int, block: int = 16) -> int:
    """The cached tokens of turn `turn` of a conversation alternating pods, checked: none on the first turn (a miss),
    else everything the other pod processed (`previous_prompt` tokens) up to its last full block."""
    cached = cached_tokens(resp)
    if turn == 0:
        assert cached == 0 and resp.headers["x-kv-cache"] == "miss", (turn, cached)
    else:
        assert cached >= (previous_prompt // block) * block > 0, (turn, cached, previous_prompt)
        assert resp.headers["x-kv-cache"] in ("hit", "partial"), turn
    return cached


def resume_session(a: str, b: str, session_id: str, messages: list[dict[str, str]], questions: list[str], *,
                   max_tokens: int, timeout_s: float, between: Any) -> tuple[httpx.Response, httpx.Response]:
    """A server-side session of `messages` started on the pod at URL `a` with questions[0], `between()`, then
    continued on the pod at `b` with questions[1]: both turns, the second checked to hit the first's whole prompt."""
    created = httpx.post(a + "/v1/sessions", json={"session_id": session_id, "messages": messages}, timeout=timeout_s)
    assert created.status_code == 201, created.text
    turns = []
    for url, question in ((a, questions[0]), (b, questions[1])):
        if turns:
            between()
        turn = httpx.post(f"{url}/v1/sessions/{session_id}/messages",
                          json={"content": question, "max_tokens": max_tokens}, timeout=timeout_s)
        assert turn.status_code == 200, turn.text
        turns.append(turn)
    first, second = turns
    assert second.headers["x-kv-cache"] == "hit"
    assert cached_tokens(second) >= first.json()["usage"]["prompt_tokens"]
    return first, second


@contextmanager
def tiny_pods(redis_url: str) -> Iterator[dict[str, PodProcess]]:
    """Two caching tiny-random pods (`a`, `b`) and one without the cache (`plain`), as processes."""
    with running({
        "a": PodProcess("pod-a", redis_url, "tiny-random", POD_ARGS),
        "b": PodProcess("pod-b", redis_url, "tiny-random", POD_ARGS),
        "plain": PodProcess("pod-plain", redis_url, "tiny-random", POD_ARGS, no_cache=True),
    }) as procs:
        yield procs


# -- a pod in-process (Starlette TestClient) ------------------------------------------------

HISTORY = [
    {"role": "system", "content": "You are a helpful assistant. " * 20},
    {"role": "user", "content": "Tell me about the history of the printing press in Europe, in detail."},
]

SHORT_HISTORY = [{"role": "system", "content": "You answer briefly. " * 3},
                 {"role": "user", "content": "Hello there!"}]


def make_client(redis: RedisProcess | str, engine: Any, /, **overrides: Any) -> TestClient:
    """An in-process pod around a loaded `engine` (exact codec, 16-token blocks unless told); use it as a context
    manager. `redis`: a server or its URL."""
    from service.app import create_app  # noqa: PLC0415 - the codec's tests need no pod
    from service.settings import PodSettings  # noqa: PLC0415

    url = redis if isinstance(redis, str) else redis.url
    defaults: dict[str, Any] = {"model": "tiny-random", "redis_url": url, "codec": "exact", "block_tokens": 16,
                                "pod_name": "pod-test"}
    return TestClient(create_app(PodSettings(**{**defaults, **overrides}), engine=engine),
                      raise_server_exceptions=False)


@contextmanager
def pod_pair(redis: RedisProcess | str, engines: Any, names: tuple[str, str] = ("a", "b"), /,
             **overrides: Any) -> Iterator[tuple[TestClient, TestClient]]:
    """Two in-process pods of one fleet on one Redis, settings as `make_client`'s: on `engines["a"]` and
    `engines["b"]` (a dict), or both on one engine."""
    pair = engines if isinstance(engines, dict) else {"a": engines, "b": engines}
    with make_client(redis, pair["a"], **{"pod_name": names[0], **overrides}) as a, \
            make_client(redis, pair["b"], **{"pod_name": names[1], **overrides}) as b:
        yield a, b


def chat(client: TestClient, messages: list[dict[str, str]], *, model: str = "tiny-random", max_tokens: int = 12,
         **extra: Any) -> Any:
    """A greedy chat completion; `headers` are HTTP headers, never a body field (the pod refuses unknown ones)."""
    headers = extra.pop("headers", None) or {}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body, headers=headers)


def follow_up(a: TestClient, b: TestClient, history: list[dict[str, str]], **chat_args: Any) -> tuple[Any, Any]:
    """A chat of `history` on pod `a`, its writes done, then the next turn ("And?") on pod `b` (which may be `a`):
    both replies' JSON. The second caches `computed_tokens(first)` when it hits everything `a` computed."""
    first = ok(chat(a, history, **chat_args)).json()
    wait_written(a)
    reply = first["choices"][0]["message"]["content"]
    follow = [*history, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    return first, ok(chat(b, follow, **chat_args)).json()


def computed_tokens(reply: Any) -> int:
    """The tokens whose KV a pod computed for a reply's JSON: the prompt and the reply, less its last token."""
    return int(reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] - 1)


def complete(client: TestClient, prompt: list[int] | str, *, model: str = "tiny-random", max_tokens: int = 1,
             **extra: Any) -> Any:
    """A greedy text completion of `prompt` (token ids or text), checked to succeed: its JSON."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return ok(client.post("/v1/completions", json=body)).json()


def ok(resp: Any) -> Any:
    """`resp`, checked to be a 200 (its body in the failure)."""
    assert resp.status_code == 200, resp.text
    return resp


def server_completion(post: Any, prompt: list[int] | str, *, n_predict: int = 8, **body: Any) -> dict[str, Any]:
    """llama-server's own /completion, greedy and reusing its slot's cache, through `post` (a sidecar's or a
    llama-server's client's): its JSON, checked to be a 200, with the response's headers under "headers"."""
    resp = ok(post("/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                         "cache_prompt": True, **body}))
    out: dict[str, Any] = resp.json()
    out["headers"] = dict(resp.headers)
    return out


def wait_written(client: TestClient, timeout_s: float = 15.0) -> None:
    """Until the in-process pod's background write queue is empty and nothing is being written."""
    state = client.app.state.pod  # type: ignore[attr-defined]
    wait_for(lambda: not state.writer.depth, "the background writes to finish", timeout_s)  # queued + in flight


# -- llama-servers ---------------------------------------------------------------------------

@contextmanager
def sidecar_servers(model: Path, slot_dir: Path, threads: int, ctx: int,
                    reference_slots: int = 1) -> Iterator[tuple[Any, Any, str]]:
    """Two sidecars' llama-servers of `model` (spawned as `kvstash sidecar --spawn` spawns them) and the URL of a
    reference llama-server with the same settings (`--swa-full` for a sliding-window model, as they have),
    `reference_slots` slots of its own saving to `slot_dir`; all stopped after."""
    from service.engines.llama.llamaserver import SWA_FULL, LlamaServerEngine  # noqa: PLC0415
    from service.engines.llama.llamaserverproc import LlamaServerProcess  # noqa: PLC0415

    a = LlamaServerEngine.spawn(str(model), parallel=1, threads=threads, ctx_per_slot=ctx)
    b = LlamaServerEngine.spawn(str(model), parallel=1, threads=threads, ctx_per_slot=ctx)
    reference = LlamaServerProcess(model, slot_dir, parallel=reference_slots, ctx_per_slot=ctx, threads=threads,
                                   extra_args=(SWA_FULL,) if a.layout.sliding_count else ())
    reference.start()
    try:
        yield a, b, reference.url
    finally:
        reference.stop()
        a.close()
        b.close()


# -- TLS ------------------------------------------------------------------------------------

def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


@contextmanager
def tls_acl_server(tmp_path: Path, password: str, key_pattern: str) -> Iterator[tuple[RedisProcess, int, Path]]:
    """A redis-server with a TLS port (self-signed certificate) and ACL user `kv` allowed only
    `key_pattern`; skips the test where openssl or TLS support is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = self_signed(tmp_path)
    tls_port = free_port()
    server = RedisProcess(extra_args=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
        "--user", "kv", "on", f">{password}", key_pattern, "resetchannels", "+@all", "-@admin", "-@dangerous",
    ))
    try:
        server.start()
    except RedisProcessError as exc:
        server.cleanup()
        pytest.skip(f"this redis-server cannot serve TLS: {exc}")
    try:
        yield server, tls_port, cert
    finally:
        server.cleanup()


# -- the codec's inputs and error bounds --------------------------------------------------

LEVELS = {"int4": 15, "int2": 3}  # the grouped modes' steps per range


def kv_sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # per-channel magnitudes differ, as in real keys
    scale = torch.rand(shape[0], 2, shape[2], 1, shape[4], generator=gen) * 4 + 0.1
    return (torch.randn(*shape, generator=gen) * scale + 0.5).to(dtype)


def resealed(frame: bytes | bytearray) -> bytes:
    """The frame with its checksum recomputed, so what is checked is the edit, not the checksum."""
    from cachestore.codec.frame import HEADER_SIZE, checksum  # noqa: PLC0415

    digest = checksum(bytes(frame[:HEADER_SIZE]), bytes(frame[HEADER_SIZE:]))
    return bytes(frame[:HEADER_SIZE - 8]) + struct.pack("<Q", digest) + bytes(frame[HEADER_SIZE:])


def as_retired(frame: bytes) -> bytes:
    """The frame relabelled as a retired format's (version 3, which only layer tables of int8 layers used) and
    resealed: what an older release may have left in Redis."""
    edited = bytearray(frame)
    edited[4] = 3
    return resealed(edited)


def check_gate_refuses_others(mine: str, others: Iterable[str], shape: tuple[int, ...]) -> None:
    """A pod whose codec is `mine` passes its own frame of KV `shape` and refuses, for their codec, those of each of
    `others` before decoding them (`service.cache.framegate`)."""
    from cachestore.codec import Codec  # noqa: PLC0415
    from service.cache.framegate import frame_problem  # noqa: PLC0415

    kv = kv_sample(shape, torch.float32)
    codec = Codec(mine)
    assert frame_problem(codec.encode(kv), codec.spec, list(shape), torch.float32) is None
    for other in others:
        problem = frame_problem(Codec(other).encode(kv), codec.spec, list(shape), torch.float32)
        assert problem is not None and problem.reason == "codec", other


def grouped_extreme(x: torch.Tensor, dim: int, group: int, fn: str) -> torch.Tensor:
    """amin/amax of each run of `group` slices along `dim`, broadcast back to x's shape."""
    chunks = torch.split(x, min(group, x.shape[dim]), dim=dim)
    return torch.cat([getattr(c, fn)(dim, keepdim=True).expand_as(c) for c in chunks], dim=dim)


def error_bound(mode: str, x: torch.Tensor, group: int) -> torch.Tensor:
    """Worst-case absolute error per element of `mode` on x [L, 2, H, T, D] (fp32),
    computed from the data as the mode's contract states it."""
    k, v = x[:, 0], x[:, 1]
    if mode == "int8":
        step = torch.stack([k.abs().amax(2, keepdim=True).expand_as(k),
                            v.abs().amax(3, keepdim=True).expand_as(v)], 1) / 127
        return step / 2 * 1.01
    lo = torch.stack([grouped_extreme(k, 2, group, "amin"), grouped_extreme(v, 3, group, "amin")], 1)
    hi = torch.stack([grouped_extreme(k, 2, group, "amax"), grouped_extreme(v, 3, group, "amax")], 1)
    return (hi - lo) / LEVELS[mode] / 2 * 1.01 + lo.abs() * 2.0**-10


def check_layers_decode_apart(spec: str, shapes: tuple[tuple[int, ...], ...],
                              context_dtype: torch.dtype = torch.float32, rope: Any = None) -> None:
    """Frames of `spec` (encoded with the model's `rope`, if given) of each shape [4 layers, 2, H, T, D]: any range of
    layers decodes to the whole frame's, and the frame decodes into a slice of a larger context of `context_dtype`,
    leaving the rest untouched."""
    from cachestore.codec import Codec  # noqa: PLC0415

    for shape in shapes:
        kv = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
        frame = Codec(spec, rope).encode(kv)
        whole = Codec().decode(frame, device="cpu")
        opened = Codec().open(frame, device="cpu")
        assert opened.splits_by_layer
        for first, stop in ((0, 1), (1, 3), (2, 4), (0, 4), (3, 4)):
            assert torch.equal(opened.decode_into(layers=slice(first, stop)), whole[first:stop]), (spec, first, stop)
        context = torch.full((4, 2, shape[2], shape[3] + 20, shape[4]), 7.0, dtype=context_dtype)
        Codec().decode_into(frame, context[:, :, :, 10:10 + shape[3]])
        assert torch.equal(context[:, :, :, 10:10 + shape[3]], whole.to(context_dtype))
        assert bool((context[:, :, :, :10] == 7).all()) and bool((context[:, :, :, 10 + shape[3]:] == 7).all())


# -- Redis values of one kind, read and rewritten behind the pods' backs ----------------------------------------------

def redis_values(url: str, kind: str, namespace: str = "kvstash") -> dict[bytes, bytes]:
    """Every value under `<namespace>:<kind>:` (blk, bnd, ...) on the server at `url`."""
    import redis  # noqa: PLC0415

    client = redis.Redis.from_url(url)
    try:
        return {key: client.get(key) for key in client.scan_iter(match=f"{namespace}:{kind}:*")}
    finally:
        client.close()


def rewrite_values(url: str, kind: str, change: Any, namespace: str = "kvstash") -> int:
    """Replace every value under `<namespace>:<kind>:` with `change(value)` (TTL kept); how many were rewritten."""
    import redis  # noqa: PLC0415

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:{kind}:*"))
        for key in keys:
            client.set(key, change(client.get(key)), keepttl=True)
        return len(keys)
    finally:
        client.close()


def cached_tokens(resp: Any) -> int:
    """The prompt tokens a chat completion's usage says came from the cache."""
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
