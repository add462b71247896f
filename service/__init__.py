"""The kvstash inference pod: a Starlette app that serves an LLM and rehydrates KV from Redis."""
