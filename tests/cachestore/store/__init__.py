"""Tests of cachestore.store against real Redis: standalone, Cluster, Sentinel, TLS; sessions, the breaker."""
