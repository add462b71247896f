"""kvstash operations: the CLI, benchmarks, local process orchestration and deployment files."""
