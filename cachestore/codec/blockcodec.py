"""Which codec encodes which block of a chain: the first block keeps int8 under 4- and 2-bit codecs, and a
sequence's partial last block takes the spec's /recent= mode when it names one.

Every chain starts with the tokens the model uses as its attention sink (the first few positions
draw attention from every later token). Quantizing them to 4 or 2 bits costs far more than their
share of the bytes: on SmolLM2-135M, int2/g64 everywhere raises perplexity by 37.7%, int2 with
block 0 at int8 by 7.7% (int4: +0.40% vs +0.09%). Block 0 is one block per chain, so it adds
little to a long context. Frames are self-describing, so decoding needs no policy; the policy is
part of the model fingerprint, so pods with different policies never share keys.

The rotated and clipped int2 of format 2 still needs it (same 3 windows of ops/data/sample.txt,
fake-quantized): int2/rotv/clip without the sink +81% perplexity (KL 0.76), with block 0 at int4 KL
0.050, at int8 KL 0.034. At 2048 tokens block 0 costs
one block in 32: int4+zstd 3.65x smaller than fp16 with it, int2+zstd 6.08x.

The tokens after a sequence's last full block (a session's partial block, a tail) are the most recent of any hit
that uses them, and every later token attends to them most; KIVI keeps such tokens at full precision. With
/recent=int8 they are encoded at int8 (at most block_tokens - 1 of them: a context that ends on a block boundary
costs nothing more); when the sequence grows past the block's end the full block takes the main codec.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cachestore.codec.codec import Codec
from cachestore.codec.frame import FLOAT_MODES
from cachestore.codec.rope import Rope
from cachestore.codec.spec import CodecSpec, recent_spec
from cachestore.errors import ConfigError

SINK_BLOCK_MODES = frozenset({"int4", "int2"})
SINK_MODE = "int8"


@dataclass(frozen=True)
class BlockCodecs:
    main: Codec
    sink: Codec  # the codec of block 0 (and of a partial block that starts at token 0)
    recent: Codec  # the codec of a partial last block after block 0 (main unless the spec names /recent=)

    @classmethod
    def for_spec(cls, spec: CodecSpec | str | Codec, rows: bool = False, rope: Rope | None = None) -> BlockCodecs:
        """With `rows`, exact and fp16 frames hold token rows (`CodecSpec.rows`: an engine that takes llama.cpp
        sequence states receives them where the state holds them); other modes are unchanged. `rope`: the model's
        (its engine's `KvLayout.rope`), which /unrope needs; ConfigError if it needs it and has none."""
        main = spec if isinstance(spec, Codec) else Codec(spec, rope)
        if main.spec.variant is not None and main.spec.variant.unrope and main.rope is None:
            raise ConfigError(f"codec {main.spec.name()} stores keys without their RoPE (/unrope), but the engine "
                              f"does not declare its model's RoPE (a plain rotation of the whole head, alike in every "
                              f"layer)")
        if rows and main.spec.mode in FLOAT_MODES and not main.spec.rows:
            main = Codec(replace(main.spec, rows=True), main.rope)
        if main.spec.mode not in SINK_BLOCK_MODES:
            return cls(main, main, main)
        sink = Codec(replace(main.spec, mode=SINK_MODE, group_size=CodecSpec().group_size, recent=""))
        return cls(main, sink, Codec(recent_spec(main.spec), main.rope) if main.spec.recent else main)

    def at(self, block_index: int) -> Codec:
        """The codec of full block `block_index`."""
        return self.sink if block_index == 0 else self.main

    def partial_at(self, block_index: int) -> Codec:
        """The codec of a partial last block (fewer than block_tokens tokens) that starts block `block_index`."""
        return self.sink if block_index == 0 else self.recent

    def name(self) -> str:
        """The policy as it goes into model fingerprints, e.g. `int2+lz4/g64` + `,sink=int8+lz4`."""
        main = self.main.spec.name()
        return main if self.sink is self.main else f"{main},sink={self.sink.spec.name()}"
