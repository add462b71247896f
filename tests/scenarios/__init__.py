"""Scenario suites across packages: faults, hostile input, security and a fleet of pods (RELIABILITY.md)."""
