"""Tests of the sidecar beside real llama-server processes."""
