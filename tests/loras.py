"""Tiny LoRA adapters for a GGUF model, written here with the `gguf` package: random low-rank updates of every
layer's K and V projections (what changes the KV cache), in the layout llama.cpp's adapter loader checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_lora(path: Path, model: Path, seed: int, rank: int = 4, std: float = 0.1) -> Path:
    """An adapter of `rank` for `model`'s attn_k and attn_v weights, its values drawn from `seed`."""
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(str(model))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    for tensor in reader.tensors:
        if not tensor.name.endswith((".attn_k.weight", ".attn_v.weight")):
            continue
        n_in, n_out = (int(d) for d in tensor.shape[:2])  # ggml order: ne[0] is the input width
        # llama.cpp: lora_a is ne [n_in, rank], lora_b ne [rank, n_out] (numpy shapes are the reverse)
        writer.add_tensor(tensor.name + ".lora_a", rng.normal(0, std, (rank, n_in)).astype(np.float32))
        writer.add_tensor(tensor.name + ".lora_b", rng.normal(0, std, (n_out, rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
