"""Signed values: an AES-256-GMAC over a value's Redis key name and its bytes, in a trailer after them.

With a frame key (`StoreSettings.frame_key`), every value the store writes ends in this 36-byte trailer (version 2):

    offset (from the end)  size  field
                      -36    12  nonce    random (os.urandom) for each value sealed
                      -24    16  tag      AES-256-GMAC under the nonce of u32 LE len(name), name (UTF-8), body (all
                                          of it additional data: nothing is encrypted)
                       -8     4  key id   the first 4 bytes of a BLAKE3 derived from the signing key: which key signed
                       -4     3  magic    b"KVM"
                       -1     1  version  2

`body` is the value as it would be stored without a key (a frame of `cachestore.codec.frame`, a tail or reply-ids record
of `cachestore.tails`), byte for byte, so the frame formats themselves do not change. A session record (a HASH) keeps
the same trailer in its field `mac`, over its key name and its fields (`fields_message`).

The tag covers the key name, so a value moved to another key (another block, conversation, tenant or model) fails,
as does any value written by a party without the key, however well formed and checksummed. A reader knows the
current key and, during a rotation, the previous one; the key id says which signed a value (ids of other keys are
"signed by neither"). A value in the version-1 trailer (40 bytes, keyed BLAKE3, before this version) is signed by
neither as well: a miss, replaced by the next write of its key.

The nonce lies in the trailer, after the body, so a tag is checked once the whole value is there: a read landing in
place checks each value as its trailer lands (`cachestore.store.reads.Sealed`), while its body is still in the cache
and the values after it are still on the wire.

A reader without this module refuses a signed value cleanly: a frame's stored length no longer matches its header's
payload length (and a tail's or reply record's checksum no longer matches).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

MAC = "aes-256-gmac"  # what signs values (bench JSON records it)
NONCE_BYTES = 12
GMAC_BYTES = 16
TAG_BYTES = NONCE_BYTES + GMAC_BYTES  # what `Signer.tag` returns and a trailer starts with: nonce, then GMAC tag
KEY_ID_BYTES = 4
MAGIC = b"KVM"
VERSION = 2
TRAILER = struct.Struct(f"<{TAG_BYTES}s{KEY_ID_BYTES}s3sB")
TRAILER_SIZE = TRAILER.size  # 36
_KEY_CONTEXT = "kvstash 2026-12 frame gmac key v2"
_ID_CONTEXT = "kvstash 2026-12 frame key id v1"
_NAME = struct.Struct("<I")
Buffer = bytes | bytearray | memoryview


def derive_key(secret: str) -> bytes:
    """The 32-byte AES-256 key of a configured secret (any length, any text)."""
    return blake3.blake3(secret.encode("utf-8"), derive_key_context=_KEY_CONTEXT).digest()


def key_id(key: bytes) -> bytes:
    return blake3.blake3(key, derive_key_context=_ID_CONTEXT).digest()[:KEY_ID_BYTES]


def _name_prefix(name: str) -> bytes:
    raw = name.encode("utf-8")
    return _NAME.pack(len(raw)) + raw


class Mac:
    """The tag of one value fed in pieces (its name first, then its body in order), as a running GMAC under `nonce`
    (a fresh random one by default)."""

    __slots__ = ("_ctx", "_tag", "nonce")

    def __init__(self, key: bytes, name: str, nonce: bytes | None = None) -> None:
        self._tag: bytes | None = None
        self.nonce = os.urandom(NONCE_BYTES) if nonce is None else bytes(nonce)
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError(f"a GMAC nonce is {NONCE_BYTES} bytes, not {len(self.nonce)}")
        self._ctx = Cipher(algorithms.AES(key), modes.GCM(self.nonce)).encryptor()
        self._ctx.authenticate_additional_data(_name_prefix(name))

    def __call__(self, piece: Buffer) -> None:
        self._ctx.authenticate_additional_data(piece)

    def tag(self) -> bytes:
        """The nonce and GMAC tag (`TAG_BYTES`): the trailer's first field. Feeding ends here."""
        if self._tag is None:
            self._ctx.finalize()
            self._tag = self.nonce + self._ctx.tag
        return self._tag


def _verifies(key: bytes, name: str, pieces: Iterable[Buffer], tag: bytes) -> bool:
    """Whether `tag` (nonce, GMAC tag) is the GMAC of `pieces` under `name` and `key`."""
    nonce, gmac = tag[:NONCE_BYTES], tag[NONCE_BYTES:]
    ctx = Cipher(algorithms.AES(key), modes.GCM(nonce, gmac)).decryptor()
    ctx.authenticate_additional_data(_name_prefix(name))
    for piece in pieces:
        ctx.authenticate_additional_data(piece)
    try:
        ctx.finalize()
    except InvalidTag:
        return False
    return True


class Signer:
    """Seals values under the current key; opens values sealed under the current or the previous key."""

    def __init__(self, current: str, previous: str = "") -> None:
        if not current:
            raise ValueError("a signer needs a current key")
        self.key = derive_key(current)
        self.key_id = key_id(self.key)
        self._keys = {self.key_id: self.key}
        if previous:
            old = derive_key(previous)
            self._keys.setdefault(key_id(old), old)

    def __repr__(self) -> str:
        return f"Signer(key id {self.key_id.hex()}, {len(self._keys)} accepted)"

    def tag(self, name: str, pieces: Iterable[Buffer], key: bytes | None = None, nonce: bytes | None = None) -> bytes:
        """The nonce and GMAC tag of `pieces` under `name` (a fresh random nonce unless given)."""
        mac = Mac(self.key if key is None else key, name, nonce)
        for piece in pieces:
            mac(piece)
        return mac.tag()

    def trailer(self, tag: bytes) -> bytes:
        return TRAILER.pack(tag, self.key_id, MAGIC, VERSION)

    def seal(self, name: str, body: Buffer) -> bytes:
        """`body` with its trailer: what is stored under `name`."""
        return bytes(body) + self.trailer(self.tag(name, (body,)))

    def accepts(self, kid: bytes) -> bool:
        """Whether `kid` names the current or the previous key."""
        return kid in self._keys

    def key_of(self, trailer: Buffer) -> bytes | None:
        """The accepted key a trailer names, or None (not a trailer, or signed by neither key)."""
        if len(trailer) != TRAILER_SIZE:
            return None
        _, kid, magic, version = TRAILER.unpack(bytes(trailer))
        if magic != MAGIC or version != VERSION:
            return None
        return self._keys.get(kid)

    def check(self, name: str, pieces: Sequence[Buffer], trailer: Buffer) -> bool:
        """Whether `trailer` signs `pieces` (the body, in order) under `name` with an accepted key."""
        key = self.key_of(trailer)
        if key is None:
            return False
        return _verifies(key, name, pieces, bytes(trailer[:TAG_BYTES]))

    def open(self, name: str, value: Buffer) -> memoryview | None:
        """The body of a value sealed under `name` with an accepted key, or None."""
        view = memoryview(value).cast("B") if not isinstance(value, memoryview) or value.format != "B" else value
        if len(view) < TRAILER_SIZE:
            return None
        body, trailer = view[:-TRAILER_SIZE], view[-TRAILER_SIZE:]
        return body if self.check(name, (body,), trailer) else None

    # -- session records: a HASH, its trailer in the field `mac` ----------------------------------

    def seal_fields(self, name: str, pairs: Sequence[Any]) -> bytes:
        """The `mac` field's value for a record's field/value pairs (flat, as `sessions.to_fields` gives them)."""
        return self.trailer(self.tag(name, (fields_message(pairs),)))

    def open_fields(self, name: str, raw: dict[bytes, bytes], names: Sequence[str]) -> bool:
        """Whether a record read back (`raw`, HGETALL's map) carries a `mac` over its fields `names` under `name`."""
        trailer = raw.get(b"mac")
        if trailer is None or any(n.encode() not in raw for n in names):
            return False
        pairs: list[Any] = []
        for n in names:
            pairs += [n, raw[n.encode()]]
        return self.check(name, (fields_message(pairs),), trailer)


def fields_message(pairs: Sequence[Any]) -> bytes:
    """The bytes a record's MAC covers: each field and value length-prefixed (u32 LE), in order."""
    out = bytearray()
    for item in pairs:
        raw = item if isinstance(item, bytes | bytearray) else str(item).encode("utf-8")
        out += _NAME.pack(len(raw)) + raw
    return bytes(out)


def signed_by(value: Buffer) -> bytes | None:
    """The key id in a value's trailer, or None where the value ends in no trailer (for reports)."""
    if len(value) < TRAILER_SIZE:
        return None
    _, kid, magic, version = TRAILER.unpack(bytes(memoryview(value)[-TRAILER_SIZE:]))
    return kid if magic == MAGIC and version == VERSION else None
