"""What the llamacpp engine would continue from its own in-memory prefix: one llama.cpp sequence kept between turns.

A context built as the engine builds its own (service.engines.llama.llamacpp: the same model and context parameters,
threads and flash attention), fed as the engine's scheduler feeds one request alone: a prompt in pieces of its
prefill chunk, each reply token alone. A later prompt keeps the cells of the prefix it shares with the sequence so far,
as llama-server's slots and llama-cpp-python's `Llama` keep theirs, and feeds only the rest. Greedy replies, with the
log-probability of each token as the engine's sampler computes it from the same logits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.engines.llama.scheduler import N_BATCH, PREFILL_CHUNK
from service.engines.llama.vocab import Vocab

CTX = 8192  # the engine's context of one sequence at most (its MAX_SEQ_CONTEXT), else the model's training context


class KeptSequence:
    """One sequence of llama.cpp kept in memory between greedy completions."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        import llama_cpp  # noqa: PLC0415

        self._lib = lib = llama_cpp
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = False
        self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = min(CTX, int(lib.llama_model_n_ctx_train(self._model)))
        cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = N_BATCH, N_BATCH, 1
        cparams.n_threads = cparams.n_threads_batch = threads or os.cpu_count() or 1
        cparams.kv_unified = False
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        self._vocab = lib.llama_model_get_vocab(self._model)
        self._n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self._batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self._text = Vocab(lib, self._vocab)
        self.seq: list[int] = []  # the tokens whose cells the sequence holds

    def complete(self, prompt: list[int], max_tokens: int, stop: str = "") -> tuple[list[int], list[float]]:
        """The greedy reply to `prompt` up to the token that ends it (an end-of-generation token, or one whose text
        completes `stop`), which it includes, and each reply token's log-probability; the sequence then holds the
        prompt and the reply but its last token. Like the engine, it decodes nothing past the reply's end: cells of
        tokens decoded and then dropped from the sequence change how llama.cpp continues it (measured: the same
        state bytes, other logits)."""
        keep = 0
        while keep < min(len(self.seq), len(prompt) - 1) and self.seq[keep] == prompt[keep]:
            keep += 1
        self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(self._ctx), 0, keep, -1)
        self.seq = prompt[:keep]
        logits = self._feed(prompt[keep:])
        reply: list[int] = []
        logprobs: list[float] = []
        while True:
            token = int(torch.argmax(logits))
            reply.append(token)
            logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
            if (self._lib.llama_vocab_is_eog(self._vocab, token) or len(reply) == max_tokens
                    or stop and stop in self._text.decode(reply)):
                return reply, logprobs
            logits = self._feed([token])

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` after the sequence in pieces of PREFILL_CHUNK; the last one's logits [vocab]."""
        batch: Any = self._batch
        for at in range(0, len(tokens), PREFILL_CHUNK):
            piece = tokens[at:at + PREFILL_CHUNK]
            for i, token in enumerate(piece):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, len(self.seq) + i, 1, 0
                batch.seq_id[i][0] = 0
            batch.logits[len(piece) - 1] = 1
            batch.n_tokens = len(piece)
            if self._lib.llama_decode(self._ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            self.seq += piece
        row = self._lib.llama_get_logits_ith(self._ctx, len(piece) - 1)
        return torch.from_numpy(np.ctypeslib.as_array(row, shape=(self._n_vocab,)).copy())

    def close(self) -> None:
        self._lib.llama_batch_free(self._batch)
        self._lib.llama_free(self._ctx)
        self._lib.llama_model_free(self._model)
