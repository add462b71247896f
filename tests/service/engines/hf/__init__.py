"""Tests of service.engines.hf: the transformers engine, its cache adapter, batching and models."""
