"""Compaction methods, chosen by name through a lazy registry.

    from compactor.methods import get_method
    method = get_method("am-omp-fast", k=4, tau=2)
    layer = method.compact_layer(keys, values, queries, budgets)

Importing this package imports no method module; :func:`get_method` does on demand.
"""

from compactor.methods.base import (
    CompactionMethod,
    Selection,
    get_method,
    list_methods,
    register_method,
)

__all__ = ["CompactionMethod", "Selection", "get_method", "list_methods", "register_method"]
