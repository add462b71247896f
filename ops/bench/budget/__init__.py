"""`kvstash bench budget`: a conversation trace replayed through the real store under each eviction policy."""
