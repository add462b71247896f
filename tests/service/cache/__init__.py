"""Tests of service.cache: lookup, rehydration, the fetch plan and the pod-local memory cache."""
