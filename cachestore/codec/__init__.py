"""The KV block codec: quantize -> pack -> compress -> frame, and back, for untrusted bytes.

    codec = Codec("int4+zstd:3/g64")
    frame = codec.encode(kv)        # kv: [layers, 2, kv_heads, tokens, head_dim]
    kv2 = codec.decode(frame)       # any mode's frame: frames describe themselves

Its modules: `spec` (the spec grammar, `CodecSpec`), `frame` (the frame header: pack, parse, checksum), `plan`
(where a frame's sections lie), `verify` (frames checked before anything reads them), `codec` (`Codec`: encode and
decode), `views` (`OpenFrame`, and frames read where they landed: `PlacedFrame`, `FrameRun`), `layout`, `quant`,
`dequant` and `q8` (quantization of each mode, and llama.cpp's q8_0 rows), `compress` (lz4, zstd, byte shuffle),
`kernels` (native dequantization, `_kernels.c`), `attend` (attention over landed codes) and `blockcodec` (which codec
encodes which block).
"""

from cachestore.codec.blockcodec import BlockCodecs
from cachestore.codec.codec import Codec
from cachestore.codec.frame import FrameHeader
from cachestore.codec.spec import DEFAULT_GROUP, DEFAULT_VARIANTS, RECENT_MODES, CodecSpec, recent_spec
from cachestore.codec.verify import DEFAULT_MAX_ELEMENTS, read_header, verify_frame, verify_placed
from cachestore.codec.views import FrameRun, OpenFrame, PlacedFrame

__all__ = ["DEFAULT_GROUP", "DEFAULT_MAX_ELEMENTS", "DEFAULT_VARIANTS", "RECENT_MODES", "BlockCodecs", "Codec",
           "CodecSpec", "FrameHeader", "FrameRun", "OpenFrame", "PlacedFrame", "read_header", "recent_spec",
           "verify_frame", "verify_placed"]
