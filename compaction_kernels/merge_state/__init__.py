"""Merge two partial attention states by their log-sum-exp (cascade attention).

Backends: :mod:`.reference` (torch) and :mod:`.triton`; importing this package loads
neither triton nor any backend module.
"""
