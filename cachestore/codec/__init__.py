"""The KV block codec: quantize -> pack -> compress -> frame, and back, for untrusted bytes.

    codec = Codec("int4+zstd:3/g64")
    frame = codec.encode(kv)        # kv: [layers, 2, kv_heads, tokens, head_dim]
    kv2 = codec.decode(frame)       # any mode's frame: frames describe themselves

KV is a numpy array, or a torch tensor on any device (quantized there): one source serves both (`arrays`, through
array-api-compat; torch is imported only where a tensor or a torch device is given), and both make the same bytes.
`decode` gives a numpy array unless it is asked for a torch device; `decode_into` writes into the caller's array.

Its modules: `spec` (the spec grammar, `CodecSpec`), `frame` (the frame header: pack, parse, checksum), `plan`
(where a frame's sections lie), `verify` (frames checked before anything reads them), `codec` (`Codec`: encode and
decode), `views` (`OpenFrame`, and frames read where they landed: `PlacedFrame`, `FrameRun`), `layout`, `quant`,
`grouped`, `quantsplit`, `dequant`, `rotation` and `q8` (quantization of each mode, the values' Hadamard rotation,
and llama.cpp's q8_0 rows), `compress` (lz4, zstd, byte shuffle), `kernels` (native dequantization, `_kernels.c`),
`attend` (attention over landed codes), `arrays` (numpy and torch through the Array API) and `blockcodec` (which
codec encodes which block).
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
