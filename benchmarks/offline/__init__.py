"""Benchmarks that need a CPU and the embedded model, no server."""
