"""Tests of service.engines.llama: llama.cpp in-process and as pods, its state and slot files."""
