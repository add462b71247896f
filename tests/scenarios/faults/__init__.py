"""Faults: Redis killed, paused or corrupted, pods killed or leaving, under live traffic."""
