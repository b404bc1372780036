"""The SGLang surface the plugin depends on, and the start-up checks that refuse a broken one.

SGLang only logs a hook it cannot apply, and the radix cache overrides private methods: a
renamed name would not fail (without the `can_run_graph` gate a compacted batch would replay
a stock CUDA graph: no beta, no error). `SURFACE` names each dependency once, `SUPPORTED` the
SGLang versions it was checked against:

- `check_surface(active)`: the version is in range, every name resolves, overrides and private
  methods keep the parameters the plugin uses, private counters are still set by SGLang's code;
  serving-only symbols (`Symbol.serving`) only with `active`;
- `sglang_ext.adapter.applied_hooks.hook_problems(pairs)`: each (target, hook) pair is in
  `HookRegistry._patched` and its target holds a `HookRegistry` wrapper around the hook.

`sglang_ext.adapter.hooks.verify_process` runs both for the plugin's own hooks, once per
process (where: ARCHITECTURE.md). This module imports nothing of the plugin.
"""

from __future__ import annotations

import dis
import inspect
import logging
import operator
import pkgutil
import re
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "GRAPH_GATES",
    "SUPPORTED",
    "SURFACE",
    "Symbol",
    "check_surface",
    "sglang_version",
]

logger = logging.getLogger(__name__)

# The SGLang versions this surface was checked against (release numbers; pre-/post-release
# tags are ignored: 0.5.23.post1 counts as 0.5.23).
SUPPORTED = (">=0.5.23", "<0.5.24")

# The hook targets (sglang_ext.adapter.hooks.FLAG_HOOKS / SERVING_HOOKS take them from here).
CONFIGURE_LOGGER = "sglang.srt.utils.common.configure_logger"
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
INGEST_REQUESTS = f"{SCHEDULER}.ingest_requests"
INIT_DISAGGREGATION = f"{SCHEDULER}.init_disaggregation"
_PD = "sglang.srt.disaggregation"  # pd.py; retraction.py hooks these where SGLang defines them
RETRACT_BACKUP, RETRACT_RESTORE, RETRACT_DISCARD = (  # (SGLang carries a hook to importers)
    f"sglang.srt.mem_cache.common.{n}"
    for n in ("backup_kv_cache", "restore_kv_cache", "discard_kv_cache_backup")
)
MOONCAKE_HOST_INDICES = f"{_PD}.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices"
EARLY_SEND = "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"
METADATA_GLUE_ENV = "SGLANG_ENABLE_METADATA_GLUE_GRAPH"  # refused with compaction on
WEIGHT_UPDATER = (
    "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
)
WEIGHT_UPDATES = tuple(
    f"{WEIGHT_UPDATER}.update_weights_from_{src}"
    for src in ("disk", "tensor", "distributed", "ipc")
)
GRAPH_RUNNERS = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner",
)
GRAPH_GATES = tuple(f"{runner}.can_run_graph" for runner in GRAPH_RUNNERS)
GRAPH_CAPTURE = f"{GRAPH_RUNNERS[0]}.capture"  # a BEFORE hook: the compacted graph variant
INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
PLUGINS_LOADED = "sglang.srt.plugins._plugins_loaded"  # set by load_plugins(), which applies hooks

Kind = Literal["import", "hook", "override", "private"]


@dataclass(frozen=True)
class Symbol:
    """One SGLang name the plugin depends on.

    `kind`: `import` (by name), `hook` (a hook's target: AFTER, unless `why` says BEFORE),
    `override` (a method the plugin's subclass redefines: the base class must define it),
    `private` (a private method or attribute the plugin calls or reads, or an instance
    attribute it writes, which SGLang's code must still set). `serving`: checked only where
    compaction is on. `params`: the parameter names the plugin relies on (None: unchecked),
    all or, with `prefix`, the first ones. `calls`: a name the target must still call.
    """

    kind: Kind
    target: str
    why: str
    serving: bool = True
    params: tuple[str, ...] | None = None
    prefix: bool = False
    calls: str | None = None


def _imports(module: str, names: str, why: str, serving: bool = True) -> list[Symbol]:
    return [Symbol("import", f"{module}.{n}", why, serving) for n in names.split()]


def _hook(target: str, why: str, params: tuple[str, ...], serving: bool = True) -> Symbol:
    return Symbol("hook", target, why, serving, params, prefix=True)


_MEM = "sglang.srt.mem_cache"
_ATTN = "sglang.srt.layers.attention"
_RUNNER_UTILS = "sglang.srt.model_executor.runner_utils"
_REGISTRY = "sglang.srt.plugins.hook_registry"
_RADIX = f"{_MEM}.radix_cache.RadixCache"
_BACKEND = f"{_ATTN}.base_attn_backend.AttentionBackend"
_FWD = ("self", "q", "k", "v", "layer", "forward_batch")
_CACHE = "CompactionRadixCache subclasses RadixCache"
_POOLS = ("req_to_token_pool", "token_to_kv_pool_allocator", "backend")

# fmt: off
SURFACE: tuple[Symbol, ...] = (
    *_imports(_REGISTRY, "HookRegistry HookType", "registers the hooks", serving=False),
    *_imports(f"{_MEM}.radix_cache", "RadixCache RadixKey TreeNode", "the radix tree"),
    *_imports(f"{_MEM}.base_prefix_cache",
              "DecLockRefParams DecLockRefResult EvictParams EvictResult IncLockRefResult",
              "the radix cache's API types"),
    *_imports(f"{_ATTN}.attention_registry", "ATTENTION_BACKENDS register_attention_backend",
              "registers and builds attention backends"),
    *_imports(f"{_MEM}.registry", "get_radix_cache_factory register_radix_cache_backend",
              "registers the `compaction` radix cache"),
    *_imports("sglang.srt.server_args", "ATTENTION_BACKEND_CHOICES add_attention_backend_choices",
              "adds `compaction` to --attention-backend"),
    *_imports("sglang.srt.arg_groups.model_override_base", "get_default_attn_backend",
              "the backend wrapped when --attention-backend is unset"),
    *_imports(f"{_ATTN}.base_attn_backend", "AttentionBackend", "CompactionBackend's base"),
    *_imports("sglang.srt.layers.radix_attention", "AttentionType", "refuses non-decoder layers"),
    *_imports(f"{_MEM}.memory_pool", "KVWriteLoc", "writes new K/V as the stock code does"),
    _hook(CONFIGURE_LOGGER, "announces the plugin and runs these checks in each process",
          ("server_args",), serving=False),
    _hook(ADD_CLI_ARGS, "adds the --compaction-* flags", ("parser",), serving=False),
    _hook(FROM_CLI_ARGS, "reads the flags, selects the plugin's backends, turns serving on",
          ("args",), serving=False),
    _hook(INIT_DISAGGREGATION, "the CPU prefill switch (pd.py)", ("self",), serving=False),
    *(Symbol("private", t, f"the CPU prefill switch (pd.py) {why}", serving=False)
      for t, why in ((MOONCAKE_HOST_INDICES, "turns it off (_send_kv_chunk reads it)"),
                     (f"sglang.srt.environ.envs.{EARLY_SEND}", "names it (a CUDA event)"),
                     (f"{SCHEDULER}.enable_overlap", "reads it"))),
    *(Symbol("private", f"{_MEM}.base_prefix_cache.BasePrefixCache.{name}", "PD decode calls "
             f"it on the plugin's cache: it must call {calls}", params=("self", arg),
             prefix=True, calls=calls) for name, arg, calls in (("lock", "node", "inc_lock_ref"),
             ("unlock", "lock", "dec_lock_ref"), ("evict_for_alloc", "params", "evict"))),
    *(_hook(t, "a retracted PD decode request keeps its compacted prefix", ("req", "tree_cache",
            *rest)) for t, rest in ((RETRACT_BACKUP, _POOLS), (RETRACT_RESTORE, _POOLS),
                                    (RETRACT_DISCARD, ("backend",)))),
    _hook(INGEST_REQUESTS, "the scheduler's safe point: installs finished compactions",
          ("self",)),
    Symbol("import", f"{SCHEDULER}.is_fully_idle", "an idle scheduler writes an install whole",
           params=("self",), prefix=True),
    *(_hook(t, "drops compacted prefixes made for the old weights", ("self", "recv_req"))
      for t in WEIGHT_UPDATES),
    *(_hook(t, "a batch with a compacted request runs eagerly, never a stock CUDA graph",
            ("self", "forward_batch")) for t in GRAPH_GATES),
    _hook(INIT_NEW, "marks each request's compacted prefix on the ForwardBatch, on the host",
          ("batch", "model_runner")),
    Symbol("private", f"sglang.srt.environ.envs.{METADATA_GLUE_ENV}", "refused: a metadata "
           "graph per batch size would serve compacted batches the stock preparation"),
    _hook(GRAPH_CAPTURE, "a compacted decode graph variant (BEFORE hook)", ("self",)),
    *(Symbol("private", f"{GRAPH_RUNNERS[0]}.{n}", f"the compacted variant: {why}", calls=c)
      for n, why, c in (("attention_graph_variants", "its labels", None),
                        ("_resolve_attention_variant", "selects it", "select"))),
    Symbol("import", f"{_RUNNER_UTILS}.capture_mode.get_capture_attention_variant",
           "tells which graph variant is being captured"),
    Symbol("override", f"{_RADIX}.__init__", f"{_CACHE}: builds the tree", params=("self", "params")),
    *(Symbol("override", f"{_RADIX}.{name}", f"{_CACHE}: {why}", params=("self", *params))
      for name, params, why in (
          ("reset", (), "drops compacted nodes and their beta"),
          ("checkpoint", ("req", "up_to"), "keeps requests that predate an install off it"),
          ("evict", ("params",), "frees compacted nodes' physical slots"),
          ("inc_lock_ref", ("node",), "counts compacted nodes physically"),
          ("dec_lock_ref", ("node", "params"), "counts compacted nodes physically"),
          ("total_size", (), "counts compacted nodes physically"),
          ("_match_prefix_helper", ("node", "key"), "matches through compacted nodes"),
          ("_insert_helper", ("node", "key", "value", "priority", "inserted_len"),
           "inserts below compacted nodes"),
          ("_inc_hit_count", ("node",), "feeds hits to the trigger"),
          ("_delete_leaf", ("node",), "deletes compacted nodes"),
      )),
    Symbol("override", f"{_BACKEND}.init_forward_metadata", "CompactionBackend: per-forward "
           "decision", params=("self", "forward_batch")),
    *(Symbol("override", f"{_BACKEND}.{name}", "CompactionBackend: biased attention for "
             "compacted batches", params=params, prefix=True)
      for name, params in (("init_forward_metadata_out_graph", ("self", "forward_batch")),
                           ("init_forward_metadata_in_graph", ("self", "forward_batch")),
                           ("init_cuda_graph_state", ("self", "max_bs")),
                           ("forward", _FWD), ("forward_extend", _FWD), ("forward_decode", _FWD))),
    *(Symbol("private", f"{_RADIX}.{name}", f"{_CACHE}: {why}")
      for name, why in (("evictable_size_", "writes the counter for compacted nodes"),
                        ("protected_size_", "writes the counter for compacted nodes"),
                        ("evictable_leaves", "removes deleted compacted leaves"))),
    Symbol("private", f"{_RADIX}._split_node", f"{_CACHE}: splits a path it retires",
           params=("self", "key", "child", "split_len")),
    Symbol("private", f"{_RADIX}._update_leaf_status", f"{_CACHE}: keeps the leaf set",
           params=("self", "node")),
    *(Symbol("private", f"{_REGISTRY}.HookRegistry.{name}", why, serving=False)
      for name, why in (("_hooks", "lists this plugin's registered hooks"),
                        ("_patched", "tells which hook targets SGLang applied"))),
    Symbol("private", "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw",
           "asks the graph runners' can_run_graph (the gate) before it replays a graph",
           calls="can_run_graph"),
    Symbol("private", PLUGINS_LOADED, "tells whether load_plugins() "
           "(and so HookRegistry.apply_hooks) ran in this process", serving=False),
    Symbol("private", f"{_REGISTRY}._wrap_fn", "recognises SGLang's hook wrappers",
           serving=False, params=("original_fn", "hook", "hook_type")),
)
# fmt: on


def sglang_version() -> str:
    """The installed SGLang distribution's version (`unknown` without its metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt,
}  # fmt: skip


def _release(text: str) -> tuple[int, ...]:
    """The release numbers a version starts with ("0.5.23.post1" -> (0, 5, 23))."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if m is None:
        raise ValueError(f"cannot read a release number from version {text!r}")
    parts = [int(p) for p in m.group(1).split(".")]
    return tuple(parts + [0] * (4 - len(parts)))


def in_supported(version: str, supported: Iterable[str] = SUPPORTED) -> bool:
    """Whether `version` satisfies every clause of `supported` (`>=`, `<`, ... a version).

    Raises:
        ValueError: a clause without a known operator, or an unreadable version.
    """
    have = _release(version)
    for clause in supported:
        op = next((o for o in _OPS if clause.startswith(o)), None)
        if op is None:
            raise ValueError(f"SUPPORTED clause {clause!r} has no operator ({', '.join(_OPS)})")
        if not _OPS[op](have, _release(clause[len(op) :])):
            return False
    return True


def check_surface(active: bool) -> list[str]:
    """Problems with SGLang's surface in this process: the version, and each symbol of
    `SURFACE` (serving-only ones with `active`), one line each naming the symbol and the
    installed SGLang version. Empty: all found as the plugin uses them."""
    version = sglang_version()
    try:
        ok = in_supported(version)
    except ValueError:
        ok = False
    problems = [] if ok else [
        f"sglang {version}: outside the versions the plugin was checked against "
        f"({', '.join(SUPPORTED)})"
    ]  # fmt: skip
    for sym in SURFACE:
        if sym.serving and not active:
            continue
        try:
            what = _problem(sym)
        except Exception as exc:  # an import that fails for another reason is a problem too
            what = f"cannot be resolved ({type(exc).__name__}: {exc})"
        if what:
            problems.append(
                f"{sym.kind} {sym.target}: {what}, in SGLang {version} (needed: {sym.why})"
            )
    return problems


def _problem(sym: Symbol) -> str | None:
    """What is wrong with one symbol (None: nothing)."""
    if sym.kind in ("import", "hook"):
        obj = pkgutil.resolve_name(sym.target)
        if sym.kind == "hook" and (isinstance(obj, type) or not callable(obj)):
            return f"is {type(obj).__name__}, not a function"
        return _params_problem(sym, obj)
    owner_path, name = sym.target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    if sym.kind == "override":
        if not isinstance(owner, type) or name not in vars(owner):
            return f"not defined by {owner_path.rsplit('.', 1)[-1]} itself any more"
        return _params_problem(sym, getattr(owner, name))
    if hasattr(owner, name):
        obj = getattr(owner, name)
        if sym.calls and not _loads(inspect.unwrap(obj).__code__, sym.calls):
            return f"no longer calls {sym.calls}"
        return _params_problem(sym, obj)
    if isinstance(owner, type) and _stored_by(owner, name):
        return None
    return "neither defined nor set by SGLang's code any more"


def _params_problem(sym: Symbol, obj: Any) -> str | None:
    if sym.params is None:
        return None
    try:
        have = tuple(inspect.signature(obj).parameters)  # follows a hook wrapper's __wrapped__
    except (TypeError, ValueError) as exc:
        return f"has no readable signature ({exc})"
    want = sym.params
    if have == want or (sym.prefix and have[: len(want)] == want):
        return None
    return (
        f"takes ({', '.join(have)}), the plugin expects ({', '.join(want)}{', ...' * sym.prefix})"
    )


def _stored_by(cls: type, name: str) -> bool:
    """Whether a function of `cls` or its bases (not `object`) assigns `self.<name>`."""
    for klass in cls.__mro__[:-1]:
        for value in vars(klass).values():
            fn = getattr(value, "__func__", value)
            if callable(fn):  # a hooked method: SGLang's wrapper keeps it as __wrapped__
                fn = inspect.unwrap(fn)
            code = getattr(fn, "__code__", None)
            if isinstance(code, types.CodeType) and _stores(code, name):
                return True
    return False


def _stores(code: types.CodeType, name: str) -> bool:
    """Whether `code` (or code nested in it) assigns attribute `name`."""
    return _uses(code, name, ("STORE_ATTR",))


def _loads(code: types.CodeType, name: str) -> bool:
    """Whether `code` (or code nested in it) reads attribute or method `name`."""
    return _uses(code, name, ("LOAD_ATTR", "LOAD_METHOD"))


def _uses(code: types.CodeType, name: str, ops: tuple[str, ...]) -> bool:
    if any(i.opname in ops and i.argval == name for i in dis.get_instructions(code)):
        return True
    return any(isinstance(c, types.CodeType) and _uses(c, name, ops) for c in code.co_consts)
