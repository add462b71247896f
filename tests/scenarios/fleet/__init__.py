"""Fleets of real pod processes: turns alternating pods, stateless clients."""
