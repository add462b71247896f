"""Benchmarks: each prints a table and writes JSON rows with --json."""
