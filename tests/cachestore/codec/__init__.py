"""Tests of cachestore.codec: round trips, error bounds, golden frames and the native kernels."""
