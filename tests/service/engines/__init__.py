"""Tests of service.engines: the engines behind the one seam, and the kvgeom models."""
