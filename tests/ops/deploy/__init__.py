"""Tests of the deployment files: compose, Kubernetes, nginx and haproxy, without a container engine."""
