"""Tests of the pod, service/: its HTTP API, cache pipeline, engines, runtime and sidecar."""
