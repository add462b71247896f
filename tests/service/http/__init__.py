"""Tests of service.http: the OpenAI-compatible routes, sessions, parameters and tool replies."""
