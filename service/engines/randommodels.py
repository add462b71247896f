"""Random-weight models built here, nothing downloaded: a transformers config of a fixed seed, saved with SmolLM2's
tokenizer and chat template, and converted to GGUF by the converter of the pinned llama.cpp (the one `make
llama-server` extracts from the llama-cpp-python sdist, run in a subprocess with its gguf-py on the path).

The kvgeom models (service.engines.kvgeom) and the tests' tiny architectures (tests.tinymodels) are built this way;
each build is cached in the model cache dir under a digest of its spec, recipe and versions (`build_key`)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.engines.llama.llamaserverproc import DEFAULT_BINARY

LLAMA_BUILD_ROOT = DEFAULT_BINARY.parent.parent  # what `make llama-server` builds in: bin/, src/, version


@dataclass(frozen=True)
class RandomSpec:
    """One random model: its name, its transformers config class and model class (by name), and the config's fields
    beyond the vocabulary and special tokens."""

    name: str
    config_class: str
    model_class: str
    fields: dict[str, Any]


def llama_cpp_version() -> str:
    """The llama-cpp-python version whose llama.cpp converts: the one `make llama-server` built, else the one
    installed (its sdist is extracted before the build), else ""."""
    stamp = LLAMA_BUILD_ROOT / "version"
    if stamp.is_file():
        return stamp.read_text().strip()
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return ""


def llama_cpp_source() -> Path:
    """The vendor/llama.cpp of the pinned llama-cpp-python sdist (`make llama-server` extracts it)."""
    return LLAMA_BUILD_ROOT / "src" / f"llama_cpp_python-{llama_cpp_version()}" / "vendor" / "llama.cpp"


def converter_missing() -> str | None:
    """Why no GGUF can be built here (one line), or None."""
    source = llama_cpp_source()
    if not llama_cpp_version() or not (source / "convert_hf_to_gguf.py").is_file():
        return f"no llama.cpp converter at {source} (run `make llama-server`)"
    if not (source / "gguf-py" / "gguf").is_dir():
        return f"no gguf-py beside the converter in {source}"
    return None


def build_key(spec: RandomSpec, recipe: str, seed: int, gguf: bool = True) -> str:
    """A digest of what a build depends on: the spec, the recipe, the seed, the transformers version and, for a build
    with a GGUF, llama.cpp's."""
    import transformers  # noqa: PLC0415

    versions = {"transformers": transformers.__version__}
    if gguf:
        versions["llama-cpp-python"] = llama_cpp_version()
    blob = json.dumps({"recipe": recipe, "seed": seed, "spec": spec.__dict__, **versions}, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def save_hf(spec: RandomSpec, tokenizer: Any, out: Path, seed: int, half: bool = False) -> None:
    """The transformers directory of `spec` in `out`: its config, random weights of `seed` (float16 when `half`), and
    `tokenizer` (a directory or a loaded tokenizer)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True) if isinstance(tokenizer, Path) else tokenizer
    config = getattr(transformers, spec.config_class)(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        **spec.fields,
    )
    with torch.random.fork_rng(devices=[]):  # a fixed seed without touching the caller's RNG
        torch.manual_seed(seed)
        model = getattr(transformers, spec.model_class)(config).eval()
    if half:
        model = model.half()
    model.save_pretrained(out)
    tok.save_pretrained(out)


def convert_gguf(hf_dir: Path, outfile: Path, model_name: str) -> None:
    """Convert the transformers directory `hf_dir` to an f16 GGUF `outfile` with the pinned llama.cpp's converter."""
    source = llama_cpp_source()
    with tempfile.TemporaryDirectory() as stubs:
        path = [str(source / "gguf-py")]
        if importlib.util.find_spec("sentencepiece") is None:
            # Llama's converter imports sentencepiece before it looks for tokenizer.model, and falls back to
            # tokenizer.json only on FileNotFoundError: an empty stand-in lets it get that far
            (Path(stubs) / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
            path.append(stubs)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(
            [sys.executable, str(source / "convert_hf_to_gguf.py"), str(hf_dir),
             "--outfile", str(outfile), "--outtype", "f16", "--model-name", model_name],
            env=env, capture_output=True, text=True, check=False,
        )
    if done.returncode:
        raise RuntimeError(f"converting {model_name} to GGUF failed:\n{done.stderr[-4000:]}")
