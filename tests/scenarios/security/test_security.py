"""Security: tenant isolation end to end, no unsafe deserialisation in the code, secrets kept out of every output,
Redis over TLS with an ACL user for the whole service, fail-fast start on a bad Redis URL, admin needs credentials."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachestore.settings import StoreSettings
from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from service.settings import PodSettings
from tests.faultkit import QUESTIONS, SYSTEM, chat, pod_client, reply_of, state_of, wait_written
from tests.paths import ROOT
from tests.support import POD_ARGS

REDIS_PASSWORD = "rEd1s-Pw-7c1e9b"
API_KEY_A, API_KEY_B = "sk-alpha-5f3a9e1d", "sk-beta-c0ffee42"
TENANT_SECRET = "tenant-Secret-91ab"
SECRETS = (REDIS_PASSWORD, API_KEY_A, API_KEY_B, TENANT_SECRET)


# -- tenant isolation ----------------------------------------------------------------------------

def test_tenants_share_nothing(redis_server: RedisProcess, tiny_model: Any, figures: dict[str, object]) -> None:
    keys = {API_KEY_A: "alpha", API_KEY_B: "beta"}
    a = {"Authorization": f"Bearer {API_KEY_A}"}
    b = {"X-API-Key": API_KEY_B}
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    with pod_client(redis_server.url, tiny_model, api_keys=keys, tenant_secret=TENANT_SECRET) as pod:
        assert chat(pod, messages, session_id="shared-name", headers=a).status_code == 200
        wait_written(pod)
        r = redis_server.client()
        blocks_after_a = set(r.scan_iter(match="kvstash:blk:*"))
        hit = chat(pod, messages, headers=a)
        assert hit.headers["x-kv-cache"] == "hit"
        # B sends A's exact prompt, and A's session id: a miss that reads none of A's keys (no timing signal)
        store = state_of(pod).store
        read_before = (store.stats().blocks_read, store.stats().bytes_read)
        other = chat(pod, messages, session_id="shared-name", headers=b)
        assert other.headers["x-kv-cache"] == "miss"
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert (store.stats().blocks_read, store.stats().bytes_read) == read_before, "B's lookup read A's blocks"
        wait_written(pod)
        blocks_after_b = set(r.scan_iter(match="kvstash:blk:*"))
        assert blocks_after_a < blocks_after_b and len(blocks_after_b) == 2 * len(blocks_after_a)
        # sessions: nothing of A's can be read, listed, forked, continued or deleted by B
        created = pod.post("/v1/sessions", json={"session_id": "private", "messages": [SYSTEM]}, headers=a)
        assert created.status_code == 201
        for method, path, body in (("GET", "/v1/sessions/private", None),
                                   ("DELETE", "/v1/sessions/private", None),
                                   ("POST", "/v1/sessions/private/fork", {"session_id": "stolen"}),
                                   ("POST", "/v1/sessions/private/messages", {"content": "hi", "max_tokens": 2})):
            resp = pod.request(method, path, json=body, headers=b)
            assert resp.status_code == 404, (method, path, resp.text)
        listed = {s["id"] for s in pod.get("/v1/sessions", headers=b).json()["data"]}
        assert "private" not in listed
        assert pod.post("/v1/sessions", json={"session_id": "private"}, headers=b).status_code == 201  # B's own
        mine = pod.get("/v1/sessions/private", headers=a).json()
        assert mine["messages"] == [SYSTEM] and mine["version"] == 1
        assert r.exists("kvstash:sess:alpha:private") and r.exists("kvstash:sess:beta:private")
        assert not r.exists("kvstash:sess:beta:stolen")
        r.close()
        for resp in (pod.get("/v1/sessions"), pod.get("/v1/models"), chat(pod, messages),
                     chat(pod, messages, headers={"Authorization": "Bearer " + API_KEY_A[:-1]})):
            assert resp.status_code == 401
    figures.update(cross_tenant_hits=0, cross_tenant_session_calls_refused=4, unauthenticated_refused=4)


# -- code scan -----------------------------------------------------------------------------------

UNSAFE_CALLS = {("pickle", "load"), ("pickle", "loads"), ("torch", "load"), ("marshal", "load"), ("marshal", "loads"),
                ("yaml", "load"), ("yaml", "unsafe_load"), ("dill", "loads"), ("shelve", "open"), ("numpy", "load"),
                ("np", "load")}
UNSAFE_NAMES = {"eval", "exec", "__import__"}
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve"}
# The one allowed use: the naive baseline of the resume benchmark reloads bytes the benchmark itself wrote.
ALLOWED = {("ops/bench/resume/methods.py", "torch.load")}


def _findings(path: Path) -> list[tuple[str, int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(rel, node.lineno, f"import {n}") for n in names if n.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in UNSAFE_NAMES:
                found.append((rel, node.lineno, func.id))
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                    and (func.value.id, func.attr) in UNSAFE_CALLS:
                if func.attr == "load" and func.value.id == "yaml" and any(
                        k.arg == "Loader" and "Safe" in ast.unparse(k.value) for k in node.keywords):
                    continue
                if func.attr == "load" and func.value.id in ("numpy", "np") and any(
                        k.arg == "allow_pickle" and ast.unparse(k.value) == "False" for k in node.keywords):
                    continue
                found.append((rel, node.lineno, f"{func.value.id}.{func.attr}"))
    return found


def test_no_unsafe_deserialisation_in_the_code() -> None:
    files = [p for d in ("cachestore", "service", "ops") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 30
    findings = [f for p in files for f in _findings(p)]
    unexpected = [f for f in findings if (f[0], f[2]) not in ALLOWED]
    assert not unexpected, f"unsafe deserialisation or eval: {unexpected}"
    assert len([f for f in findings if (f[0], f[2]) in ALLOWED]) <= 1
    # the scanner itself finds what it must
    probe = ROOT / "tests" / ".scan_probe.py"
    probe.write_text("import pickle\nimport torch\nx = torch.load(b)\neval('1')\npickle.loads(b)\n")
    try:
        assert {f[2] for f in _findings(probe)} == {"import pickle", "torch.load", "eval", "pickle.loads"}
    finally:
        probe.unlink()


# -- secrets -------------------------------------------------------------------------------------

@pytest.fixture
def password_redis() -> Iterator[RedisProcess]:
    """A redis-server that requires a password (set after start, so the start-up PING needs none)."""
    server = RedisProcess().start()
    try:
        client = server.client()
        client.config_set("requirepass", REDIS_PASSWORD)
        client.close()
        yield server
    finally:
        server.cleanup()


def test_secrets_never_leave_the_pod(password_redis: RedisProcess, figures: dict[str, object]) -> None:
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{password_redis.port}/0"
    env = {"KVSTASH_API_KEYS": f"{API_KEY_A}:alpha,{API_KEY_B}:beta", "KVSTASH_TENANT_SECRET": TENANT_SECRET}
    pod = PodProcess("pod-secrets", url, "tiny-random", (*POD_ARGS, "--log-level", "info"), env=env)
    outputs: list[str] = []
    try:
        pod.start().wait_ready(120)
        a = {"Authorization": f"Bearer {API_KEY_A}"}
        body = {"model": "tiny-random", "messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 4}
        for headers in (a, {"Authorization": f"Bearer {API_KEY_A}x"}, {"X-API-Key": API_KEY_B[:5]}, {}):
            outputs.append(httpx.post(pod.url + "/v1/chat/completions", json=body, headers=headers, timeout=30).text)
        outputs.append(httpx.post(pod.url + "/v1/sessions", json={"session_id": "x"}, headers=a, timeout=10).text)
        password_redis.kill()  # errors while Redis is gone must not print the URL's password
        for _ in range(6):
            outputs.append(httpx.post(pod.url + "/v1/chat/completions", json=body, headers=a, timeout=30).text)
        outputs.append(httpx.post(pod.url + "/v1/sessions", json={}, headers=a, timeout=10).text)
        outputs.append(httpx.get(pod.url + "/v1/sessions", headers=a, timeout=10).text)
        for path in ("/metrics", "/readyz", "/healthz", "/openapi.json"):
            outputs.append(httpx.get(pod.url + path, headers=a, timeout=10).text)
    finally:
        pod.stop()
        outputs.append(pod.log_tail(100_000))
        pod.cleanup()
    outputs += [repr(PodSettings(redis_url=url, api_keys={API_KEY_A: "alpha"}, tenant_secret=TENANT_SECRET)),
                repr(StoreSettings.from_url(url)), str(StoreSettings.from_url(url).masked_url)]
    text = "\n".join(outputs)
    assert "pod ready" in text  # the log really was captured
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"secrets leaked: {leaked}"
    figures.update(outputs_checked=len(outputs), bytes_checked=len(text), secrets_leaked=0)


# -- start-up: a misconfigured Redis URL fails fast ----------------------------------------------

def _serve(url: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", "tiny-random", "--redis-url", url,
                           "--port", "1"], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _serve_in_process(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from ops.cli import main  # noqa: PLC0415

    rc = main(["serve", "--model", "tiny-random", "--redis-url", url, "--port", "1"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("kind", ["scheme", "wrong-password", "tls-to-plain", "option"])
def test_misconfigured_redis_url_fails_fast(kind: str, password_redis: RedisProcess,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    port = password_redis.port
    url = {
        "scheme": f"http://127.0.0.1:{port}/0",
        "wrong-password": f"redis://:not-{REDIS_PASSWORD}@127.0.0.1:{port}/0",
        "tls-to-plain": f"rediss://:{REDIS_PASSWORD}@127.0.0.1:{port}/0",
        "option": f"redis://127.0.0.1:{port}/0?budget_bytes=lots",
    }[kind]
    t0 = time.monotonic()
    rc, err = _serve_in_process(url, capsys)
    assert rc == 2 and err.startswith("kvstash: error:") and err.count("\n") == 1, err
    assert REDIS_PASSWORD not in err
    assert time.monotonic() - t0 < 15


def test_misconfigured_serve_process_exits_without_traceback(password_redis: RedisProcess) -> None:
    """The same, as an operator sees it: a real `kvstash serve` process."""
    url = f"redis://:not-{REDIS_PASSWORD}@127.0.0.1:{password_redis.port}/0"
    done = _serve(url)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "refused the credentials" in done.stderr, done.stderr
    assert REDIS_PASSWORD not in done.stderr + done.stdout


# -- TLS with certificate verification and an ACL user, for the whole service --------------------

@pytest.fixture
def tls_acl(tmp_path: Path) -> Iterator[tuple[RedisProcess, int, Path]]:
    """TLS Redis with ACL user `kv` limited to `kvstash:*` as docs/keys.md recommends."""
    from tests.support import tls_acl_server  # noqa: PLC0415

    with tls_acl_server(tmp_path, REDIS_PASSWORD, "~kvstash:*") as found:
        yield found


def test_full_service_over_tls_as_a_limited_acl_user(tls_acl: tuple[RedisProcess, int, Path], tiny_model: Any,
                                                     figures: dict[str, object]) -> None:
    import redis  # noqa: PLC0415

    server, tls_port, cert = tls_acl
    url = f"rediss://kv:{REDIS_PASSWORD}@127.0.0.1:{tls_port}/0?tls_ca_path={cert}"
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    with pod_client(url, tiny_model) as pod:
        first = chat(pod, messages)
        assert first.headers["x-kv-cache"] == "miss"
        wait_written(pod)
        second = chat(pod, messages)
        assert second.headers["x-kv-cache"] == "hit" and reply_of(second) == reply_of(first)
        assert pod.post("/v1/sessions", json={"session_id": "tls-1", "messages": [SYSTEM]}).status_code == 201
        turn = pod.post("/v1/sessions/tls-1/messages", json={"content": QUESTIONS[1], "max_tokens": 6})
        assert turn.status_code == 200, turn.text
        wait_written(pod)
        turn2 = pod.post("/v1/sessions/tls-1/messages", json={"content": QUESTIONS[2], "max_tokens": 6})
        assert turn2.headers["x-kv-cache"] == "hit"
        assert pod.post("/v1/sessions/tls-1/fork", json={"session_id": "tls-2"}).status_code == 201
        assert {s["id"] for s in pod.get("/v1/sessions").json()["data"]} == {"tls-1", "tls-2"}
        assert pod.delete("/v1/sessions/tls-2").status_code == 200
        store = state_of(pod).store
        assert store.stats().errors == 0 and store.breaker_state == "closed"
        assert pod.get("/readyz").json()["redis"].startswith("up")
    # the same user can do nothing else
    user = redis.Redis(host="127.0.0.1", port=tls_port, ssl=True, ssl_ca_certs=str(cert), username="kv",
                       password=REDIS_PASSWORD)
    for call in (lambda: user.set("other:key", b"x"), lambda: user.flushall(), lambda: user.config_get("*"),
                 lambda: user.keys("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    user.close()
    # a real `kvstash serve` starts with this URL (its start-up check passes TLS, AUTH and the ACL)
    pod_proc = PodProcess("pod-tls", url, "tiny-random", POD_ARGS)
    try:
        pod_proc.start().wait_ready(120)
        resp = httpx.post(pod_proc.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-random", "messages": messages, "max_tokens": 8})
        assert resp.status_code == 200 and resp.headers["x-kv-cache"] == "hit"
    finally:
        pod_proc.cleanup()
    figures.update(tls=True, cert_verified=True, acl_user="kv ~kvstash:* -@admin -@dangerous", store_errors=0)


@pytest.mark.parametrize("kind", ["untrusted-ca", "acl-namespace"])
def test_tls_or_acl_misconfiguration_fails_fast(kind: str, tls_acl: tuple[RedisProcess, int, Path],
                                                 tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support import self_signed  # noqa: PLC0415

    server, tls_port, cert = tls_acl
    base = f"rediss://kv:{REDIS_PASSWORD}@127.0.0.1:{tls_port}/0"
    if kind == "untrusted-ca":
        other_dir = tmp_path / "other"
        other_dir.mkdir()
        url = f"{base}?tls_ca_path={self_signed(other_dir)[0]}"
    else:
        url = f"{base}?tls_ca_path={cert}"
        monkeypatch.setenv("KVSTASH_NAMESPACE", "elsewhere")  # outside the user's ~kvstash:* pattern
    rc, err = _serve_in_process(url, capsys)
    assert rc == 2 and err.startswith("kvstash: error:"), err
    assert ("TLS" in err) if kind == "untrusted-ca" else ("may not use the keys" in err), err
    assert REDIS_PASSWORD not in err


@pytest.mark.parametrize("url", [
    f"redis+sentinel://u:{REDIS_PASSWORD}@h1:1,h2:2/mymaster", f"rediss://kv:{REDIS_PASSWORD}@127.0.0.1:6/0?x=1",
    f"unix:///tmp/r.sock?password={REDIS_PASSWORD}", f"redis://127.0.0.1:6/0?db=0&password={REDIS_PASSWORD}",
    f"redis://:{REDIS_PASSWORD}@h:1"])
def test_every_url_shape_is_masked_in_reprs(url: str) -> None:
    shown = [repr(PodSettings(redis_url=url)), repr(StoreSettings.from_url(url))]
    assert all(REDIS_PASSWORD not in s and "***" in s for s in shown), shown


# -- admin commands need credentials -------------------------------------------------------------

def test_admin_commands_need_credentials(password_redis: RedisProcess, tiny_model: Any,
                                         capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvstash admin` reads and changes data only with Redis credentials; the HTTP API has no admin routes."""
    from ops.cli import main  # noqa: PLC0415

    monkeypatch.delenv("KVSTASH_REDIS_URL", raising=False)
    good = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{password_redis.port}/0"
    with pod_client(good, tiny_model) as pod:
        assert pod.post("/v1/sessions", json={"session_id": "keep", "messages": [SYSTEM]}).status_code == 201
        paths = {r.path for r in pod.app.routes}  # type: ignore[attr-defined]
    assert not any("admin" in p for p in paths)
    commands = [["stats"], ["sessions"], ["show", "keep"], ["delete", "keep", "--yes"], ["verify", "--fix", "--yes"],
                ["evict", "--to-bytes", "0", "--yes"], ["purge", "--model", "0123456789abcdef", "--yes"]]
    for bad in (f"redis://127.0.0.1:{password_redis.port}/0", f"redis://:guess@127.0.0.1:{password_redis.port}/0"):
        for cmd in commands:
            rc = main(["admin", "--redis-url", bad, *cmd])
            out, err = capsys.readouterr()
            assert rc == 2 and err.startswith("kvstash: error:") and "keep" not in out, (cmd, out, err)
            assert "Traceback" not in err
    assert main(["admin", "--redis-url", good, "sessions"]) == 0
    assert "keep" in capsys.readouterr().out
    assert password_redis.client(password=REDIS_PASSWORD).exists("kvstash:sess:default:keep")
