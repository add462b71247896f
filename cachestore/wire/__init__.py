"""The wire: pipelined reads whose large values land straight in the caller's buffer.

redis-py with hiredis copies a value three times on its way to Python: from the socket into the
connection's buffer, into hiredis's reader, and into a bytes object of its own. A hit at 2048 tokens
reads 24 MB of int8 frames and then dequantizes each frame from wherever its bytes object happens to be.
Here each value of the expected length is received with `recv_into` directly into its slot of one buffer
(one copy, the kernel's), so a lookup's frames lie side by side at a fixed stride, and one layer of every
block can be dequantized in a single call (`cachestore.codec.FrameRun`).

Its modules: `targets` (where a value lands: a buffer or a `Scatter`), `parser` (the one parser interface, and
which parser a socket gets), `resp` (the RESP reader in Python), `native` (the native receive of `_resp.c`) and
`exchange` (round trips on one connection).
"""

from cachestore.wire.exchange import Exchange, landable, pipelined_into
from cachestore.wire.native import NATIVE
from cachestore.wire.parser import Parser, make_parser
from cachestore.wire.resp import ProtocolError
from cachestore.wire.targets import Scatter, Target

__all__ = ["NATIVE", "Exchange", "Parser", "ProtocolError", "Scatter", "Target", "landable", "make_parser",
           "pipelined_into"]
