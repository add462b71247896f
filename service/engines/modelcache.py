"""The on-disk cache of served models kvstash builds itself (SmolLM2 converted, random-weight test and geometry
models): where it lives, a digest of a model's weights, and building an entry once across processes."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from cachestore.errors import ConfigError

META_FILE = "kvstash-model.json"
_DIGEST_CHUNK = 8 << 20


def default_cache_dir() -> Path:
    """Where converted models live: $KVSTASH_CACHE_DIR, else ~/.cache/kvstash/models."""
    from service.settings import settings_from_env  # noqa: PLC0415  (the one reader of the environment)

    configured = settings_from_env().cache_dir
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvstash" / "models"


def _weight_files(model_dir: Path) -> list[Path]:
    globs = (sorted(model_dir.glob(pattern)) for pattern in ("*.safetensors", "*.bin", "*.gguf"))
    files = next((found for found in globs if found), [])
    if not files:
        raise ConfigError(f"{model_dir} holds no *.safetensors, *.bin or *.gguf weights")
    return files


def _stat_key(files: list[Path]) -> dict[str, list[int]]:
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}


def read_meta(model_dir: Path) -> dict[str, object] | None:
    try:
        meta = json.loads((model_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def weights_digest(model_dir: Path, recipe: str = "") -> str:
    """BLAKE2b of the weight files, cached in META_FILE next to them while their size/mtime hold."""
    files = _weight_files(model_dir)
    stats = _stat_key(files)
    meta = read_meta(model_dir)
    if meta and meta.get("weights") == stats and isinstance(meta.get("model_id"), str):
        return str(meta["model_id"])
    h = hashlib.blake2b(digest_size=16, person=b"kvstash-weights")
    for path in files:
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        with path.open("rb") as fh:
            while chunk := fh.read(_DIGEST_CHUNK):
                h.update(chunk)
    model_id = "b2:" + h.hexdigest()
    meta = {"model_id": model_id, "weights": stats, "recipe": recipe or (meta or {}).get("recipe", "")}
    try:  # write then rename: a concurrent reader sees the old file or the new, never half
        tmp = model_dir / f".{META_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, model_dir / META_FILE)
    except OSError:
        pass  # a read-only model directory: recompute next time
    return model_id


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_built(target: Path, build: Callable[[Path], None], recipe: str) -> Path:
    """Build `target` once; concurrent processes wait on a lock, and a rename publishes it whole."""
    meta = read_meta(target)
    if meta and meta.get("recipe") == recipe:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        meta = read_meta(target)
        if meta and meta.get("recipe") == recipe:
            return target  # another process built it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; other users' pods read it too
            build(tmp)
            weights_digest(tmp, recipe)  # writes META_FILE last: the completeness marker
            if target.exists():
                shutil.rmtree(target)  # a stale build of an older recipe
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
