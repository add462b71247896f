"""llama-server's build is kept per machine: a fresh clone copies this machine's earlier build instead of compiling."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from ops import llamaserver_build as lsb


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "venv-llama-server"
    monkeypatch.setattr(lsb, "BUILD_ROOT", root)
    monkeypatch.setattr(lsb, "BINARY", root / "bin" / "llama-server")
    monkeypatch.setattr(lsb, "STAMP", root / "version")
    monkeypatch.setenv("KVSTASH_CACHE_DIR", str(tmp_path / "cache"))

    def no_compile(jobs: int) -> Path:
        raise AssertionError("compiled although this machine's build was cached")

    monkeypatch.setattr(lsb, "_build", no_compile)
    return root


def _executable(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_fresh_clone_copies_the_machines_earlier_build(build_root: Path) -> None:
    cached = lsb.cached_binary()
    assert cached is not None and lsb.LLAMA_CPP_PYTHON_VERSION in str(cached)
    _executable(cached, "echo 'version: 1 (test)'")
    assert lsb.build() == lsb.BINARY
    assert lsb.BINARY.read_bytes() == cached.read_bytes()
    assert lsb.binary_path() == lsb.BINARY  # stamped with the pinned version


def test_a_cached_build_that_does_not_run_is_not_used(build_root: Path) -> None:
    cached = lsb.cached_binary()
    assert cached is not None
    _executable(cached, "exit 1")  # built on another CPU, say
    with pytest.raises(AssertionError, match="compiled"):
        lsb.build()
    assert lsb.binary_path() is None


def test_the_cache_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTASH_CACHE_DIR", "off")
    assert lsb.cached_binary() is None
