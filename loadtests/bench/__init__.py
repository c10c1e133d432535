"""Benchmarks: the stack against direct vLLM and peers (run), gateway capacity, prefix cache."""
