"""Tests of the cache library, cachestore: hashing, keys, the budget, signing, tails and the wire."""
