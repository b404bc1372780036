"""Benchmarks on real SGLang servers (stock and with the plugin) and `compactor serve`, on loopback."""
