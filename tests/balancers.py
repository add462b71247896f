"""Test helpers (no tests) for the balancers in front of the pods (ops/nginx, ops/haproxy): their configs' upstream
block, and a balancer process waited for until it listens."""

from __future__ import annotations

import re
import subprocess

import httpx

from tests.timing import wait_for


def upstream_block(text: str) -> str:
    """The `upstream kvstash_pods { ... }` block of an nginx config."""
    match = re.search(r"upstream kvstash_pods \{.*?\}", text, re.S)
    assert match is not None
    return match.group(0)


def wait_listening(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 10.0) -> None:
    """Until a GET of `url` gets any answer from the balancer `proc` started (failing at once, with its stderr, if
    it exits first)."""

    def answers() -> bool:
        try:
            httpx.get(url, timeout=1)
        except httpx.TransportError:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            return False
        return True

    wait_for(answers, f"a balancer listening at {url}", timeout_s)
