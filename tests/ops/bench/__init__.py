"""Tests of ops.bench: every bench end to end on the smallest settings."""
