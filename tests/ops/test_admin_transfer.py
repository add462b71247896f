"""`kvstash admin export` / `import`: a session moves between two Redis servers and a pod resumes it with a full hit."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cachestore import transfer
from cachestore.codec import Codec
from cachestore.errors import KvstashError
from ops.cli import main
from ops.redisproc import RedisProcess
from tests.support import make_client, wait_written

SYSTEM = {"role": "system", "content": "You are a helpful travel assistant. " * 12}
POD_FLAGS = ["--model", "tiny-random", "--codec", "exact", "--block-tokens", "16"]


@pytest.fixture
def second_redis() -> Iterator[RedisProcess]:
    server = RedisProcess().start()
    try:
        yield server
    finally:
        server.cleanup()


def session_hash(redis: RedisProcess, sid: str) -> dict[bytes, bytes]:
    return redis.client().hgetall(f"kvstash:sess:default:{sid}")


def test_export_import_resumes_with_a_full_hit(redis_server: RedisProcess, second_redis: RedisProcess,
                                               tiny_model: Any, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with make_client(redis_server, tiny_model, pod_name="pod-a") as a:
        assert a.post("/v1/sessions", json={"session_id": "trip", "messages": [SYSTEM]}).status_code == 201
        for text in ("Where should I start in Lisbon?", "And what should I eat there?"):
            turn = a.post("/v1/sessions/trip/messages", json={"content": text, "max_tokens": 8})
            assert turn.status_code == 200, turn.text
        wait_written(a)
        assert a.post("/v1/sessions/trip/fork", json={"session_id": "copy"}).status_code == 201

    out = tmp_path / "trip.json"
    assert main(["admin", "--redis-url", redis_server.url, "export", "trip", str(out), *POD_FLAGS]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_bytes())
    full = len(doc["session"]["token_ids"]) // 16
    assert doc["format"] == "kvstash-session" and doc["version"] == 1 and full >= 4
    assert len(doc["blocks"]) == full and f"{full} of {full} blocks" in printed

    assert main(["admin", "--redis-url", second_redis.url, "import", str(out), *POD_FLAGS]) == 0
    assert f"{full} of {full} blocks in Redis ({full} written)" in capsys.readouterr().out
    assert session_hash(second_redis, "trip") == session_hash(redis_server, "trip")  # identical record
    assert 0 < second_redis.client().pttl("kvstash:sess:default:trip") <= 86_400_000
    # importing again refuses to overwrite, --replace without a terminal refuses too
    assert main(["admin", "--redis-url", second_redis.url, "import", str(out), *POD_FLAGS]) == 2
    assert "already exists (use --replace)" in capsys.readouterr().err
    assert main(["admin", "--redis-url", second_redis.url, "import", str(out), "--replace", *POD_FLAGS]) == 2
    assert main(["admin", "--redis-url", second_redis.url, "import", str(out), "--replace", "--yes",
                 *POD_FLAGS]) == 0
    capsys.readouterr()

    turn = {"content": "Which day trip would you suggest?", "max_tokens": 8}
    with make_client(redis_server, tiny_model, pod_name="pod-a") as a:
        reference = a.post("/v1/sessions/copy/messages", json=turn)  # the same history in the source Redis
    with make_client(second_redis, tiny_model, pod_name="pod-b") as b:
        resumed = b.post("/v1/sessions/trip/messages", json=turn)
    assert resumed.status_code == 200, resumed.text
    assert resumed.headers["x-kv-cache"] == "hit"
    usage = resumed.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= full * 16  # every block, plus the partial one
    assert usage == reference.json()["usage"]
    assert resumed.json()["choices"][0]["message"] == reference.json()["choices"][0]["message"]


def test_export_needs_the_pods_model_settings(redis_server: RedisProcess, tiny_model: Any, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with make_client(redis_server, tiny_model, pod_name="pod-a") as a:
        assert a.post("/v1/sessions", json={"session_id": "s1", "messages": [SYSTEM]}).status_code == 201
    flags = ["--model", "tiny-random", "--codec", "int8", "--block-tokens", "16"]
    assert main(["admin", "--redis-url", redis_server.url, "export", "s1", str(tmp_path / "x"), *flags]) == 2
    assert "check --model, --codec, --block-tokens" in capsys.readouterr().err
    assert main(["admin", "--redis-url", redis_server.url, "export", "nope", str(tmp_path / "x"), *POD_FLAGS]) == 2
    assert "not found" in capsys.readouterr().err


def flip(b64: str) -> str:
    raw = bytearray(base64.b64decode(b64))
    raw[60] ^= 1
    return base64.b64encode(bytes(raw)).decode()


def valid_doc(tiny_model: Any) -> dict[str, Any]:
    fp = tiny_model.fingerprint(16, "exact")
    shape = (tiny_model.num_layers, 2, tiny_model.kv_heads, 16, tiny_model.head_dim)
    block = Codec("exact").encode(torch.zeros(shape))  # [L, 2, H, 16, D]
    record = transfer.SessionRecord("default", "s", fp.short(), list(range(40)), [{"role": "user", "content": "x"}],
                                    version=2, created_at=1.5, updated_at=2.5)
    return json.loads(transfer.to_document(transfer.SessionExport(fp, record, [block, block]), exported_at=3.0))


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(version=2),
    lambda d: d.update(format="other"),
    lambda d: d.update(extra=1),
    lambda d: d["session"].update(token_ids=[1, -1]),
    lambda d: d["session"].update(token_ids=[1.5]),
    lambda d: d["session"].update(tenant="bad tenant!"),
    lambda d: d["session"].update(session_id="../etc"),
    lambda d: d["session"].update(model="0" * 16),
    lambda d: d["session"].update(version=0),
    lambda d: d["session"].update(created_at="nan"),
    lambda d: d["session"].update(messages=["not an object"]),
    lambda d: d["session"].update(partial="***"),
    lambda d: d["session"].update(partial=base64.b64encode(b"KVS1" + b"\0" * 60).decode()),
    lambda d: d["fingerprint"].update(num_layers="2"),
    lambda d: d["blocks"].append(d["blocks"][0]),  # 3 blocks for 40 tokens of 16
    lambda d: d["blocks"].__setitem__(0, flip(d["blocks"][0])),  # payload bit flip: checksum
    lambda d: d["blocks"].__setitem__(0, base64.b64encode(b"x" * 10).decode()),
    lambda d: d["fingerprint"].update(kv_heads=d["fingerprint"]["kv_heads"] + 1),
])
def test_import_rejects_malformed_files(tiny_model: Any, mutate: Any) -> None:
    doc = valid_doc(tiny_model)
    parsed = transfer.parse_document(json.dumps(doc).encode())
    assert len(parsed.blocks) == 2 and parsed.record.version == 2
    mutate(doc)
    with pytest.raises(KvstashError):
        transfer.parse_document(json.dumps(doc).encode())


def test_import_rejects_garbage_bytes() -> None:
    for data in (b"", b"\xff\xfe", b"[1,2]", b"{" * 100_000, b'{"session": ' + b"[" * 50 + b"]" * 50 + b"}",
                 b'{"format": "kvstash-session"}'):
        with pytest.raises(KvstashError):
            transfer.parse_document(data)
