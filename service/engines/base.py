"""The engine seam: everything the request path needs from a model runtime, and nothing more.

The pipeline knows token ids, KV tensors in the codec's layout [layers, 2, kv_heads, tokens, head_dim] and a
fingerprint. How a runtime (transformers, llama.cpp, a future one) keeps its cache is the engine's business alone;
what the codec and the landing must know of it, the engine declares once, as data (`KvLayout`).

An engine subclasses `Engine`. It must provide:

- `kind`, `name`, `geometry` (a `KvGeometry`), `parallel`;
- `fingerprint`, `chat_ids`, `text_ids`, `decode`, `generate`.

Optional capabilities have defaults, for an engine that keeps KV as the pipeline hands it over:

- `layerwise` False, `runs_torch` False, `kv_layout` head-major full attention (`KvLayout()`);
- `context_for` None (the pipeline dequantizes a hit into its own pooled tensor), `give_context` False;
- `landing_targets` None (frames are received into the pipeline's landing buffer), `placed_frame` (a frame
  verified where `landing_targets` put it), `mark_placed` a no-op, `is_lent` False;
- `prompt_ids` (a text completion's prompt) the plain text's `text_ids`;
- `forget` and `close` no-ops.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachestore.codec import PlacedFrame
from cachestore.codec.arrays import Array
from cachestore.codec.frame import FrameHeader
from cachestore.codec.rope import Rope
from cachestore.hashing import ModelFingerprint
from cachestore.wire import Target
from service.engines.generation import Generation, GenRequest


@dataclass(frozen=True)
class KvGeometry:
    """The shape and dtype of the KV an engine hands over and takes back."""

    num_layers: int
    kv_heads: int
    head_dim: int
    # of the KV arrays exchanged with the pipeline, in the library the engine computes with: a numpy dtype (llama.cpp's
    # engines: the sidecar runs without torch) or a torch dtype (transformers); the pipeline allocates in the same
    dtype: Any
    max_context: int  # tokens one sequence may hold (prompt + reply)


@dataclass(frozen=True)
class KvLayout:
    """How an engine's runtime holds a sequence's KV: layout only, no engine identity. The codec choice reads
    `row_frames`; the landing reads `rows_apart`. The default is a head-major cache of full-attention layers."""

    token_rows: bool = False  # per layer K then V as token rows [tokens, kv_heads, head_dim] (a llama.cpp state)
    v_transposed: bool = False  # V kept transposed, [kv_heads * head_dim, tokens] (llama.cpp without flash attention)
    rows_apart: bool = False  # rows received into a lent context lie apart from the tensor lent with it (q8_0)
    sliding: tuple[int, ...] | None = ()  # layers with a sliding window (None: some, the model does not say which)
    window: int = 0  # tokens a sliding layer keeps
    recurrent: tuple[int, ...] | None = ()  # layers that keep one recurrent state a sequence
    tag: str = ""  # what the fingerprint adds for this layout ("" for full attention only: fingerprints stay)
    rope: Rope | None = None  # the RoPE the cached keys carry, every layer alike (codec /unrope); None: not declared

    @property
    def row_frames(self) -> bool:
        """Exact and fp16 frames are written as token rows (`CodecSpec.rows`): the order the runtime holds K and V
        in, so a hit is received where the runtime reads it."""
        return self.token_rows and not self.v_transposed


class Engine(ABC):
    """A loaded model runtime. `generate` may be called from up to `parallel` threads at once."""

    kind: str  # the engine's name (service.engines.ENGINES): blocks of different engines never mix (fingerprint)
    name: str  # the model name clients send
    geometry: KvGeometry
    parallel: int
    layerwise: bool = False  # runs the cached context layer by layer: `generate` waits on `kv_ready` per layer
    runs_torch: bool = False  # `generate` runs torch on the calling thread: the pod calls it on its compute thread
    kv_layout: KvLayout = KvLayout()
    honours_all_params: bool = True  # every request parameter service.http.params parses (not so a SlotServer's)
    # sliding-window or recurrent layers beside the full-attention ones: the engine resumes only at a boundary record
    # (`generate`'s `boundary`, `Generation.boundaries`; service.cache.boundarylookup)
    boundary_records: bool = False

    @abstractmethod
    def fingerprint(self, block_tokens: int, codec_name: str) -> ModelFingerprint:
        """Names the engine, its version, the weights and every setting that changes the KV bits."""

    @abstractmethod
    def chat_ids(self, messages: list[dict[str, Any]], known: Mapping[int, list[int]] | None = None,
                 tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        """The chat's token ids ending with the assistant generation prompt; content is plain text, or the
        ids in `known` (message index -> the ids a pod generated for that message's exact text). `tools` and
        the messages' `tool_calls` are rendered as service.engines.tools says."""

    @abstractmethod
    def text_ids(self, text: str) -> list[int]:
        """Plain text as token ids (no special tokens, no BOS)."""

    def prompt_ids(self, text: str) -> list[int]:
        """A text completion's prompt as token ids: the plain text (no special tokens parsed), with what the model's
        tokenizer adds around a prompt (a GGUF's `add_bos_token`: BOS first, as llama-server's completions do). The
        default: `text_ids`, nothing added."""
        return self.text_ids(text)

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Token ids as text (special tokens skipped)."""

    @abstractmethod
    def generate(self, request: GenRequest) -> Generation:
        """Run `request` (see GenRequest); returns the reply and the KV of the whole fed sequence, or of its tokens
        from `request.keep_from` on if the engine can copy out less (then `Generation.kv_from` says so). Blocks until
        done."""

    def boundary_problem(self, state: bytes, position: int) -> str | None:
        """Why a boundary state read back from Redis (untrusted) cannot resume a sequence at `position`, or None. The
        default: this engine resumes at no boundary."""
        return "this engine keeps full-attention layers only"

    def context_for(self, tokens: int) -> Array | None:
        """A [layers, 2, kv_heads, tokens, head_dim] tensor of the engine's dtype that a hit of up to `tokens` tokens
        may be dequantized into, where the engine reads it (llama.cpp: inside a sequence state); None (the default):
        the pipeline uses its own. Handed back with `give_context`."""
        return None

    def give_context(self, kv: Array) -> bool:
        """Take back a tensor `context_for` returned; False for any other."""
        return False

    def landing_targets(self, context: Array, blocks: int, block_tokens: int,
                        checksummed: bool = True) -> Sequence[Target] | None:
        """Each of `blocks` blocks' target for a token-rows frame received into `context`, a context this engine
        lent (`context_for`): its header apart, its rows where the runtime holds them; None (the default) when
        `context` is no such context, or the engine receives no rows (frames land in the pipeline's buffer).
        `checksummed` False: the frames are signed (their MAC covers the checksum), so none is computed as they
        land."""
        return None

    def placed_frame(self, header: FrameHeader, rows: Sequence[memoryview]) -> PlacedFrame:
        """A frame verified where `landing_targets` received its `rows` (per layer its K, then its V): where the
        rows can be read from (layer 0's K and the stride to layer 1's), or nowhere when they lie apart from the
        tensor lent (`KvLayout.rows_apart`: the frame is in place already, and nothing is dequantized)."""
        return placed_rows(header, rows, apart=self.kv_layout.rows_apart)

    def mark_placed(self, context: Array, tokens: int) -> None:
        """Cells [0, tokens) of a context lent were received as rows (`landing_targets`) and verified. The default
        does nothing: no rows are received."""
        return None

    def is_lent(self, kv: Array) -> bool:
        """Whether `kv` starts where a context `context_for` lent starts, and that context has not come back."""
        return False

    def forget(self) -> None:
        """Drop what the runtime kept of earlier requests besides the cache (llama-server's slots): the next requests
        reuse only what they restore. The default keeps nothing."""
        return None

    def close(self) -> None:
        """Free the runtime; the default has nothing to free."""
        return None


_NO_BYTES = np.empty(0, dtype=np.uint8)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def placed_rows(header: FrameHeader, rows: Sequence[memoryview], *, apart: bool) -> PlacedFrame:
    """`Engine.placed_frame` for rows laid out per layer as K then V: the frame read where its rows lie (`at` layer
    0's K rows, `layer_stride` to layer 1's), or, `apart`, a frame already in its place that nothing reads."""
    if apart:  # its place is the state alone: the tensor's tokens for it stay unwritten (`mark_placed`)
        return PlacedFrame(header, _NO_BYTES)
    at = [_address(piece) for piece in rows[:3:2]]  # layer 0's K rows, and layer 1's
    return PlacedFrame(header, _NO_BYTES, at=at[0], layer_stride=at[-1] - at[0])
