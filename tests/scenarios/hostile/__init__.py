"""Hostile input: the API fuzzed, slow clients, crafted frames."""
