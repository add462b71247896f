"""Tests of service.runtime: the context pool, the allocator and threads."""
