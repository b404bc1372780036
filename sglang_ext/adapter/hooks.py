"""The plugin's hooks into SGLang, and `register()`, which installs them.

SGLang discovers the plugin through the `sglang.srt.plugins` entry point `sglang_ext:register`
(see pyproject.toml), which calls `register()` here early in every SGLang process (server,
scheduler, detokenizer). Importing this module has no side effects. Off means off: without
`--compaction-endpoint` the plugin adds its flags and nothing else (no backend, no hook that
runs per request or per forward), so a server costs and answers as stock. `register()`
installs hooks through SGLang's own `HookRegistry`, which applies them after all plugins
have run. In every process:

- AFTER `configure_logger`: announce the plugin in each process's log (with whether
  compaction is on); the first call (the main process, before it starts the others) also
  logs what the plugin changed in SGLang's config (`sglang_ext.adapter.server_args.log_changes`).
  Then check SGLang's surface and this process's hooks (`verify_process`;
  SGLang applied the hooks just before): a serving process refuses to start (RuntimeError
  naming each problem), one with compaction off logs them. The attention-backend and
  radix-cache factories repeat the check (once per process) in case this hook is missing.
- AFTER `Scheduler.init_disaggregation`: on a CPU prefill server with the Mooncake transfer
  backend, with or without `--compaction-endpoint`, turn off the sender's pinned-memory path
  SGLang's CPU engine cannot run (`sglang_ext.adapter.pd.cpu_prefill_switch`, logged).
- AFTER `ServerArgs.add_cli_args`: the `--compaction-*` flags (`sglang_ext.config`); none if
  SGLang did not apply the `from_cli_args` hook (the flags would be parsed and ignored).
- AFTER `ServerArgs.from_cli_args`: with `--compaction-endpoint`, check SGLang's surface
  (`sglang_ext.adapter.surface.check_surface`; RuntimeError naming each problem), register the plugin's
  backends, store the config on the record and select the `compaction` radix-cache backend
  and the `compaction` attention backend, which wraps the user's `--attention-backend`
  (`sglang_ext.adapter.wrapped_backend`), resolve and fingerprint the checkpoint (a directory or a
  Hub ID in the local cache) before any weights load, and set `ACTIVE_ENV` in the main
  process's environment, which the processes SGLang spawns next inherit; without it,
  nothing changes and SGLang runs stock.

Only in processes started with `ACTIVE_ENV` set (the scheduler of a server started with
`--compaction-endpoint`), the backends and the serving hooks:

- AFTER `can_run_graph` of SGLang's decode and prefill CUDA-graph runners: a batch with a
  compacted request that the compacted graph cannot serve runs eagerly
  (`sglang_ext.adapter.wrapped_backend.graph_gate`); other batches replay their graphs.
- BEFORE the decode graph runner's `capture`: a `compacted` graph variant beside the stock
  one, when the backend built compacted graphs (`sglang_ext.adapter.graph_variant`).
- AFTER `ForwardBatch.init_new`: each request's compacted prefix (or none) is stored on the
  new ForwardBatch from its ScheduleBatch's requests, on the host
  (`sglang_ext.adapter.marks.mark_forward_batch`), so the backend decides without reading the device.
- AFTER `Scheduler.ingest_requests`: the scheduler's safe point, where finished
  compactions are installed (`CompactionRadixCache.poll_compactions`); a no-op for other
  caches. Every TP rank's loop calls it once per iteration (SGLang broadcasts the inputs
  there), which makes it the place of the ranks' per-iteration agreement (`sglang_ext.tp`).
- AFTER `backup_kv_cache`, `restore_kv_cache` and `discard_kv_cache_backup` (SGLang carries
  the hook to the modules that imported them): a request retracted on a PD decode server with a `cpu_tensor` backup
  keeps its compacted prefix locked and resumes on it (`sglang_ext.adapter.retraction`).
- AFTER each `update_weights_from_*` of SGLang's scheduler weight updater: compacted
  prefixes and results in flight are dropped (`CompactionRadixCache.on_weights_updated`);
  compaction goes on only after a disk update that reloaded the very same checkpoint
  (same fingerprint), since the service holds the weights it was started with.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from sglang_ext.adapter import applied_hooks, surface
from sglang_ext.guard import HookGuard

__all__ = [
    "ACTIVE_ENV",
    "ANNOUNCEMENT",
    "FLAG_HOOKS",
    "PLUGIN_NAME",
    "SERVING_BEFORE_HOOKS",
    "SERVING_HOOKS",
    "register",
]

PLUGIN_NAME = "compaction"
ANNOUNCEMENT = "sglang_ext: compaction plugin active"
# set by the main process once --compaction-endpoint is parsed; the processes it spawns inherit it
ACTIVE_ENV = "SGLANG_COMPACTION_ACTIVE"
logger = logging.getLogger(__name__)
_mark_failed = False  # set once marking raised: later forwards are left unmarked
_registered = False
_serving = False  # whether this process registered the serving hooks (ACTIVE_ENV at register)
_GATE_GUARD = HookGuard()  # the graph gate has no cache at hand: counted per process
_GRAPH_RUNNERS = surface.GRAPH_RUNNERS


def register() -> None:
    """Entry point called by SGLang's plugin loader (idempotent): the flags always; the
    backends and the serving hooks only in a process started with `ACTIVE_ENV` set."""
    global _registered, _serving
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = list(FLAG_HOOKS)
    _serving = active()
    if _serving:
        from sglang_ext.adapter.factory import register_backends

        register_backends(verify_serving)
        hooks += SERVING_HOOKS
    for target, hook in hooks:
        HookRegistry.register(target, hook, HookType.AFTER)
    if _serving:
        for target, hook in SERVING_BEFORE_HOOKS:
            HookRegistry.register(target, hook, HookType.BEFORE)
    _registered = True


def installed_hooks() -> list[str]:
    """The targets this plugin's hooks are registered on in this process, read from SGLang's
    `HookRegistry` (short names: the last two parts of each target)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    ours = {hook for _, hook in (*FLAG_HOOKS, *SERVING_HOOKS, *SERVING_BEFORE_HOOKS)}
    return sorted(
        ".".join(target.split(".")[-2:])
        for target, hooks in HookRegistry._hooks.items()
        if any(hook in ours for _, hook, _ in hooks)
    )


def check_hooks_applied(serving: bool) -> list[str]:
    """`applied_hooks.hook_problems` for this process's hooks: `FLAG_HOOKS`, and `SERVING_HOOKS`
    with `serving`."""
    serving_hooks = (*SERVING_HOOKS, *SERVING_BEFORE_HOOKS) if serving else ()
    return applied_hooks.hook_problems([*FLAG_HOOKS, *serving_hooks])


_verified: set[tuple[bool, bool]] = set()


def verify_process(serving: bool, *, hooks: bool | None = None) -> None:
    """Check this process once: `surface.check_surface(serving)` and, with `hooks` (default:
    where SGLang applied hooks, `applied_hooks.plugins_loaded()`), `check_hooks_applied(serving)`.

    Raises:
        RuntimeError: `serving` (compaction is on here) and any problem, each named; a
            process with compaction off only logs them once as a warning.
    """
    hooks = applied_hooks.plugins_loaded() if hooks is None else hooks
    key = (serving, hooks)
    if key in _verified:
        return
    problems = surface.check_surface(serving) + (check_hooks_applied(serving) if hooks else [])
    if problems and serving:
        raise RuntimeError(
            "sglang_ext refuses to serve compacted prefixes on this SGLang: " + "; ".join(problems)
        )
    _verified.add(key)
    for problem in problems:
        logger.warning(
            "sglang_ext: %s (a server with --compaction-endpoint refuses to start)", problem
        )


def verify_serving() -> None:
    """`verify_process(True)`: what the scheduler's backend and cache factories run first."""
    verify_process(True)


def active() -> bool:
    """Whether this process serves compacted prefixes (its server has --compaction-endpoint)."""
    return os.environ.get(ACTIVE_ENV) == "1"


def _announce(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `configure_logger(server_args, prefix)`: log that the plugin is loaded in
    this process, then the config changes still noted on the record."""
    logger.info("%s (%s; hooks: %s)", ANNOUNCEMENT,
                "serving" if active() else "off: no --compaction-endpoint",
                ", ".join(installed_hooks()))  # fmt: skip
    server_args = args[0] if args else kwargs.get("server_args")
    if server_args is not None:
        from sglang_ext.adapter.server_args import log_changes

        log_changes(server_args)
    # SGLang applied the hooks before this call (load_plugins): a serving process (the
    # scheduler) on a broken surface stops here, before it builds its model and cache
    verify_process(_serving)


def _add_cli_args(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `ServerArgs.add_cli_args(parser)`: add the `--compaction-*` flags, unless
    SGLang did not apply the hook that reads them: then `--compaction-endpoint` is refused as
    an unknown flag, rather than parsed and ignored (a server without it runs stock)."""
    from sglang_ext.config import add_cli_args

    unread = applied_hooks.hook_problems([(surface.FROM_CLI_ARGS, _from_cli_args)])
    if unread:
        logger.error("sglang_ext: --compaction-* flags not added: %s", "; ".join(unread))
        return
    add_cli_args(parser)


def _from_cli_args(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `ServerArgs.from_cli_args(cls, namespace)`: read the plugin's flags."""
    from sglang_ext.adapter.server_args import apply_to_server_args
    from sglang_ext.config import config_from_namespace

    namespace = args[-1] if args else kwargs.get("args")
    try:
        cfg = config_from_namespace(namespace) if namespace is not None else None
        if cfg is not None:
            from sglang_ext.adapter.factory import check_model, register_backends

            verify_process(True, hooks=False)  # this process's hooks: flags only, applied
            register_backends(verify_serving)
            apply_to_server_args(server_args, cfg)
            check_model(server_args)  # a missing or weightless checkpoint fails before loading
    except ValueError as exc:  # a refused configuration: one line and exit 2, like argparse
        sys.stderr.write(f"{os.path.basename(sys.argv[0]) or 'sglang'}: error: {exc}\n")
        raise SystemExit(2) from None
    if cfg is not None:
        os.environ[ACTIVE_ENV] = "1"  # the scheduler and detokenizer processes inherit it
    else:
        os.environ.pop(ACTIVE_ENV, None)  # never inherited from elsewhere: off means off


def _poll_scheduler(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `Scheduler.ingest_requests`: install finished compactions; an exception
    never reaches the scheduler loop (the cache's `HookGuard` counts it, and its breaker
    stops compaction after repeated failures)."""
    cache: Any = getattr(scheduler, "tree_cache", None)
    poll = getattr(cache, "poll_compactions", None)
    if callable(poll):
        cache.guard.call("the install poll", 0, poll, idle=_idle(scheduler))


def _idle(scheduler: Any) -> bool:
    """Whether no request runs or waits (`Scheduler.is_fully_idle`): an install then has
    nothing to stall and is written whole in this iteration, instead of a layer per idle
    iteration (about one a second with `--sleep-on-idle`)."""
    is_fully_idle = getattr(scheduler, "is_fully_idle", None)
    return bool(is_fully_idle()) if callable(is_fully_idle) else False


def _graph_gate(result: Any, graph_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on a CUDA-graph runner's `can_run_graph(forward_batch)`: False for a batch
    with a compacted request (see `sglang_ext.adapter.wrapped_backend.graph_gate`)."""
    if not result:
        return None
    from sglang_ext.adapter.wrapped_backend import graph_gate

    # if deciding fails, run the batch eagerly: always correct, compacted or not
    return _GATE_GUARD.call("the CUDA-graph gate", False, graph_gate, result, graph_runner,
                            *args, **kwargs)  # fmt: skip


def _graph_variants(graph_runner: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on `DecodeCudaGraphRunner.capture(self)`: the compacted graph variant
    (`sglang_ext.adapter.graph_variant.install_variants`). If it fails, SGLang captures
    stock graphs alone and the gate keeps compacted batches eager: always correct."""
    from sglang_ext.adapter.graph_variant import install_variants

    _GATE_GUARD.call("the compacted graph variant", None, install_variants, graph_runner)


def _mark_batch(result: Any, cls: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on the classmethod `ForwardBatch.init_new(batch, model_runner, ...)`: mark
    each request's compacted prefix on the new ForwardBatch, from the ScheduleBatch's
    requests (see `sglang_ext.adapter.marks.mark_forward_batch`)."""
    global _mark_failed
    if result is None or batch is None or _mark_failed:
        return
    from sglang_ext.adapter.marks import mark_forward_batch

    try:
        mark_forward_batch(result, batch)
    except Exception:  # never take the forward down: the backend reads the rows instead
        _mark_failed = True
        logger.exception("sglang_ext: marking forward batches failed; deciding from the rows")


def _weights_updated(result: Any, manager: Any, recv_req: Any = None, *a: Any, **kw: Any) -> None:
    """AFTER hook on SGLang's `update_weights_from_*`: tell the compaction cache, with the
    fingerprint results must carry from now on (None: compaction off)."""
    cache: Any = getattr(getattr(manager, "scheduler", None), "tree_cache", None)
    update = getattr(cache, "on_weights_updated", None)
    if not callable(update):
        return
    try:
        update(weights_fingerprint(getattr(cache, "fingerprint", None), result, recv_req))
    except Exception as exc:  # never into the scheduler; and no compaction for new weights
        cache.guard.failed("a weight update", exc)
        cache.trip(f"handling a weight update raised {exc!r}")


def weights_fingerprint(current: str | None, result: Any, recv_req: Any) -> str | None:
    """`current` when a successful disk update reloaded the same checkpoint, else None.

    A failed update may have changed some weights (SGLang reports a refused cache flush
    after new weights as a failure), and other sources bring weights no service holds."""
    path = getattr(recv_req, "model_path", None)
    if current is None or not getattr(result, "success", False) or not path:
        return None
    from compactor import fingerprint

    try:
        return current if fingerprint(str(path)) == current else None
    except (OSError, ValueError) as exc:
        logger.warning("sglang_ext: cannot fingerprint %s after a weight update: %s", path, exc)
        return None


def _init_disaggregation(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `Scheduler.init_disaggregation(self)`, in every scheduler process
    (compaction on or off): the CPU prefill switch (`sglang_ext.adapter.pd.cpu_prefill_switch`).
    A failure is logged, never raised: the server starts as stock would."""
    from sglang_ext.adapter.pd import cpu_prefill_switch

    try:
        cpu_prefill_switch(scheduler)
    except Exception:
        logger.exception("sglang_ext: the CPU prefill switch failed; SGLang's own path runs")


def _retain(result: Any, req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `backup_kv_cache(req, tree_cache, req_to_token_pool, allocator, backend)`,
    called by SGLang's `release_req` (PD decode retraction): keep the request's compacted
    node locked while it is retracted (`sglang_ext.adapter.retraction.retain`)."""
    backend = args[2] if len(args) > 2 else kwargs.get("backend")
    if result and getattr(tree_cache, "guard", None) is not None:
        from sglang_ext.adapter.retraction import retain

        retain(req, tree_cache, str(backend))  # not guarded either: see _repoint


def _repoint(result: Any, req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `restore_kv_cache(req, tree_cache, req_to_token_pool, allocator, backend)`
    as PD decode's resume calls it: point the row back at the retained compacted prefix
    (`sglang_ext.adapter.retraction.repoint`). Not guarded: a request resumed without its
    compacted prefix would read packed entries as plain tokens, so a failure stops the
    scheduler, as a failure of SGLang's own restore would."""
    if getattr(tree_cache, "guard", None) is not None:
        from sglang_ext.adapter.retraction import repoint

        pool = args[0] if args else kwargs.get("req_to_token_pool")
        allocator = args[1] if len(args) > 1 else kwargs.get("token_to_kv_pool_allocator")
        repoint(req, tree_cache, pool, allocator)


def _release(result: Any, req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `discard_kv_cache_backup(req, tree_cache, backend)` as PD decode and the
    scheduler's abort call it: unlock the compacted node retained for a request that never
    resumes."""
    guard = getattr(tree_cache, "guard", None)
    if guard is not None:
        from sglang_ext.adapter.retraction import release

        guard.call("releasing a retracted request's compacted prefix", False, release, req,
                   tree_cache)  # fmt: skip


# The hooks every process installs, each AFTER its target: the flags, the announcement, and
# the CPU prefill switch (it acts only in a CPU prefill scheduler with the Mooncake backend).
FLAG_HOOKS: tuple[tuple[str, Any], ...] = (
    (surface.CONFIGURE_LOGGER, _announce),
    (surface.ADD_CLI_ARGS, _add_cli_args),
    (surface.FROM_CLI_ARGS, _from_cli_args),
    (surface.INIT_DISAGGREGATION, _init_disaggregation),
)
# The hooks a serving process (ACTIVE_ENV set) installs too, each AFTER its target.
SERVING_HOOKS: tuple[tuple[str, Any], ...] = (
    (surface.INGEST_REQUESTS, _poll_scheduler),
    *((target, _weights_updated) for target in surface.WEIGHT_UPDATES),
    *((target, _graph_gate) for target in surface.GRAPH_GATES),
    (surface.INIT_NEW, _mark_batch),
    (surface.RETRACT_BACKUP, _retain),
    (surface.RETRACT_RESTORE, _repoint),
    (surface.RETRACT_DISCARD, _release),
)
# ... and these, each BEFORE its target.
SERVING_BEFORE_HOOKS: tuple[tuple[str, Any], ...] = ((surface.GRAPH_CAPTURE, _graph_variants),)
