"""kvstash's library: KV block codec, prefix hashing, and the Redis block store."""

from cachestore.errors import CodecError, ConfigError, KvstashError, StoreError

__all__ = ["CodecError", "ConfigError", "KvstashError", "StoreError"]
