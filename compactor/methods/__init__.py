"""Compaction methods, chosen by name through a lazy registry.

    from compactor.methods import LayerInput, get_method
    method = get_method("am-omp-fast", k=4, tau=2)
    result = method.compact(LayerInput(keys, values, queries, budgets))  # .layer, .report
    layer = method.compact_layer(keys, values, queries, budgets)  # the same layer

Every method's name is in one table (:data:`METHODS`, :mod:`.registry`); importing this
package imports no method module: :func:`get_method` / :func:`method_class` do on demand.
"""

from compactor.methods.base import (
    CompactionMethod,
    LayerInput,
    MethodResult,
    Picked,
    ScoreMethod,
    SelectingMethod,
    Selection,
)
from compactor.methods.registry import (
    METHODS,
    MethodInfo,
    describe_methods,
    get_method,
    list_methods,
    method_class,
    register_method,
)

__all__ = [
    "METHODS",
    "CompactionMethod",
    "LayerInput",
    "MethodInfo",
    "MethodResult",
    "Picked",
    "ScoreMethod",
    "SelectingMethod",
    "Selection",
    "describe_methods",
    "get_method",
    "list_methods",
    "method_class",
    "register_method",
]
