"""Compaction of shared-prefix KV caches (Attention Matching and friends).

Importing this package has no side effects: no torch thread changes, no model loading.
"""

__version__ = "0.1.0"
