"""Tests of ops/: the admin CLI, the demo, generated docs, the private Redis and the benches' tools."""
