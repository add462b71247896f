"""The exception tree of cachestore; every error it raises derives from KvstashError.

    KvstashError
    ├── CodecError        a frame could not be encoded or is not a valid frame
    │   └── RetiredFrame  a frame of a format kvstash no longer reads (a miss, like any other)
    ├── ConfigError       settings are missing, malformed or inconsistent
    └── StoreError        a store operation was refused (never raised for a miss)
        └── ValueTooLarge a value exceeds the configured maximum size
"""


class KvstashError(Exception):
    """Root of every error raised by cachestore."""


class CodecError(KvstashError):
    """A tensor cannot be encoded, or bytes are not a valid kvstash frame."""


class RetiredFrame(CodecError):
    """A frame of a retired format: only codecs kvstash no longer has wrote it."""


class ConfigError(KvstashError):
    """Settings are missing, malformed or inconsistent."""


class StoreError(KvstashError):
    """A store operation was refused. A cache miss is never an error."""


class ValueTooLarge(StoreError):
    """A value is larger than the store's configured maximum value size."""
