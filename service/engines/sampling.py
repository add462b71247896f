"""Choosing the next token from logits: penalties, a grammar's mask, temperature, top-k, min-p, top-p, logprobs.

Every engine that samples in Python (hf, llamacpp) calls one `Sampler` per choice. Nothing here changes the KV of a
token: a sampling setting changes which token is fed next, never what feeding a token stores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from service.engines.generation import GenParams, TokenLogprob

# token id -> its text and its bytes (a byte-level token may hold part of a UTF-8 character)
TokenText = Callable[[int], tuple[str, bytes]]


class Guide(Protocol):
    """A grammar the reply must follow (service.engines.guides): masks what it forbids, follows what is chosen."""

    def mask(self, scores: torch.Tensor) -> None:
        """Set the scores [vocab] of every token the grammar forbids next to -inf, in place."""
        ...

    def accept(self, token: int) -> bool:
        """Follow the chosen token; True when the grammar is complete and allows nothing more."""
        ...


def make_generator(params: GenParams, device: torch.device | str = "cpu", choice: int = 0) -> torch.Generator | None:
    """The random source of one choice: None when greedy; seeded `seed + choice` when the request names a seed."""
    if params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed((params.seed + choice) % 2**64)
    return generator


def pick(scores: torch.Tensor, params: GenParams, generator: torch.Generator | None) -> int:
    """The next token from processed scores [vocab]: the argmax, or a sample after temperature, top-k, min-p and
    top-p."""
    if params.temperature == 0 or generator is None:
        return int(torch.argmax(scores))
    scores = scores.float()
    # shift first: the top score becomes exactly 0, so a tiny temperature gives -inf, never inf - inf = nan
    # (and float32 has no 1e-300: a temperature that small would divide by zero)
    probs = torch.softmax((scores - scores.max()) / max(params.temperature, 1e-30), dim=-1)
    if params.top_k and params.top_k < probs.shape[0]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (always at least the top token)
        mass = sorted_probs.sum()
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p * mass
        keep[0] = True  # even when top_p is below float32's smallest number
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """One choice's sampling state: its random source, the tokens it has seen, its grammar and its logprobs."""

    def __init__(self, params: GenParams, prompt: Sequence[int], *, choice: int = 0, guide: Guide | None = None,
                 token_text: TokenText | None = None, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = make_generator(params, device, choice)
        self.guide = guide
        self._token_text = token_text
        self._seen = set(prompt) if params.repetition_penalty != 1.0 else set()  # the prompt counts for it
        self._counts: dict[int, int] = {}  # the reply's tokens, for presence and frequency penalties
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        if self.logprobs is not None and token_text is None:
            raise ValueError("logprobs need the engine's token text")

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        changes = (self.guide is not None or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                   or p.frequency_penalty != 0.0 or bool(p.logit_bias))
        if not changes:
            return logits
        scores = logits.float().clone()
        if p.repetition_penalty != 1.0 and self._seen:
            ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=scores.device)
            picked = scores[ids]
            scores[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            ids = torch.tensor(list(self._counts), dtype=torch.long, device=scores.device)
            counts = torch.tensor(list(self._counts.values()), dtype=scores.dtype, device=scores.device)
            scores[ids] -= p.presence_penalty + p.frequency_penalty * counts
        for token, bias in p.logit_bias:
            if token < scores.shape[0]:
                scores[token] += bias
        if self.guide is not None:
            self.guide.mask(scores)
        return scores

    def next(self, logits: torch.Tensor) -> int:
        """The next token after last-position logits [vocab] (the model's raw scores)."""
        token = pick(self._processed(logits), self.params, self.generator)
        if self.logprobs is not None:
            self.logprobs.append(self._logprob(logits, token))
        self._counts[token] = self._counts.get(token, 0) + 1
        if self.params.repetition_penalty != 1.0:
            self._seen.add(token)
        return token

    def done(self, token: int) -> bool:
        """Follow `token` in the grammar; True when the grammar allows nothing more (the reply is complete)."""
        return self.guide.accept(token) if self.guide is not None else False

    def drop_last_logprob(self) -> None:
        """The last token ended the turn: it is no part of the reply's text, nor of its logprobs."""
        if self.logprobs:
            self.logprobs.pop()

    def _logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """The model's log-probabilities (before penalties, grammar and temperature), as OpenAI reports them."""
        assert self._token_text is not None and self.params.logprobs is not None
        logp = torch.log_softmax(logits.float(), dim=-1)
        top: tuple[tuple[str, bytes, float], ...] = ()
        if self.params.logprobs:
            values, ids = torch.topk(logp, self.params.logprobs)  # sorted, most likely first
            top = tuple((*self._token_text(int(i)), float(v)) for v, i in zip(values, ids, strict=True))
        text, raw = self._token_text(token)
        return TokenLogprob(text, raw, float(logp[token]), top)
