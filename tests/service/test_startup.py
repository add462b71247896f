"""A pod whose settings cannot work refuses to start in one line: a block of its model in a float codec larger than
max_value_bytes (every write of it would fail) is refused by `kvstash serve` before the port opens (exit 2), and by
the app's own start-up (the sidecar's path) as one line in place of uvicorn's traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

from cachestore.errors import ConfigError
from service.app import create_app, store_settings
from service.settings import PodSettings
from tests.paths import ROOT


def test_serve_refuses_a_block_over_max_value_bytes_in_one_line() -> None:
    env = {**os.environ, "KVSTASH_MAX_VALUE_BYTES": "4096", "KVSTASH_BUDGET_BYTES": "1000000"}
    done = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", "tiny-random", "--codec", "exact",
                           "--redis-url", "redis://127.0.0.1:1", "--port", "1"], capture_output=True, text=True,
                          timeout=120, check=False, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstash: error: a 64-token block of this model in codec exact is ") and (
        "over max_value_bytes (0.0 MiB): raise max_value_bytes (KVSTASH_MAX_VALUE_BYTES)" in last), last
    assert "Traceback" not in done.stderr


def _start(app: Any) -> list[dict[str, Any]]:
    """The app's lifespan start-up driven as a server drives it: what it sends back."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else await asyncio.Event().wait()  # type: ignore[func-returns-value]

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with pytest.raises(Exception, match="max_value_bytes"):
        asyncio.run(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}, "app": app}, receive, send))
    return sent


def test_the_apps_start_up_reports_the_refusal_as_its_one_line(tiny_model: Any) -> None:
    settings = PodSettings(redis_url="redis://127.0.0.1:1", codec="exact", max_value_bytes=4096,
                           budget_bytes=1_000_000)
    app = create_app(settings, tiny_model)
    (failed,) = [m for m in _start(app) if m["type"] == "lifespan.startup.failed"]
    assert failed["message"].startswith("kvstash: error: a 64-token block of this model in codec exact is ")
    assert "Traceback" not in failed["message"] and "\n" not in failed["message"]


def test_the_default_value_limit_fits_a_small_budget() -> None:
    """The default (32 MiB) is capped at a smaller budget: a pod of a 16 MB budget starts; an explicit limit is kept
    as given, and a negative one refused."""
    assert store_settings(PodSettings()).max_value_bytes == 32 << 20
    assert store_settings(PodSettings(budget_bytes=16_000_000)).max_value_bytes == 16_000_000
    assert store_settings(PodSettings(max_value_bytes=4096)).max_value_bytes == 4096
    with pytest.raises(ConfigError, match="max_value_bytes must be positive"):
        store_settings(PodSettings(max_value_bytes=-1))
