"""Installs on SGLang's real CPU pools: range checks in the pool's dtype, writes spread over
scheduler iterations, back-pressure, weight updates and the runner's own checks."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

from compactor.types import CompactedPrefix
from sglang_ext.adapter.hooks import weights_fingerprint
from sglang_ext.guard import HookGuard
from sglang_ext.installer import BETA_SLACK, KEY_SLACK, VALUE_SLACK, PendingInstall
from sglang_ext.kv_store import head_counts
from sglang_ext.packing import PackedLayout, slots_needed
from sglang_ext.runner import CompactionRunner, JobResult
from tests.sglang_ext._radix import (
    POOL,
    FakeRunner,
    T,
    check_accounting,
    insert_fresh,
    key,
    make_cache,
    make_req,
    release_req,
)

ROOT = Path(__file__).resolve().parents[2]


def tampered(prefix: CompactedPrefix, name: str, fn: Any) -> CompactedPrefix:
    """`prefix` with tensor `name` (e.g. ``layers.3.values``) replaced by fn(tensor)."""
    tensors = {k: v.clone() for k, v in prefix.tensors().items()}
    tensors[name] = fn(tensors[name])
    return CompactedPrefix.from_parts(prefix.metadata(), tensors)


def _nan(x: torch.Tensor) -> torch.Tensor:
    x[0, 0] = float("nan")
    return x


@pytest.mark.parametrize(
    ("name", "fn", "dtype", "why"),
    [
        ("layers.5.values", lambda x: x * 3e4, torch.float32, "max |values|"),
        ("layers.2.keys", lambda x: x * 10, torch.float32, "max |keys|"),
        ("layers.7.beta", lambda x: x + 40, torch.float32, "max beta"),
        # within the old, looser bounds (4x keys, ln T + 16), over the measured-headroom ones
        ("layers.3.keys", lambda x: x * 3, torch.float32, "max |keys|"),
        ("layers.6.beta", lambda x: x + 8, torch.float32, "max beta"),
        ("layers.1.values", _nan, torch.float32, "finite"),
        # finite in fp32, inf once cast to the fp16 pool
        ("layers.4.values", lambda x: x * 3e4, torch.float16, "not finite in torch.float16"),
    ],
)
def test_out_of_range_result_is_rejected_and_leaves_nothing(
    compacted: Any, name: str, fn: Any, dtype: torch.dtype, why: str
) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, dtype=dtype)
    insert_fresh(cache, ids)
    runner.results.append(JobResult(tuple(ids), tampered(prefix, name, fn), None, 0.1))
    assert cache.poll_compactions() == 0
    assert cache.stats.invalid == 1 and cache.stats.failures == 0 and cache.stats.installed == 0
    assert not cache.compacted_nodes()
    assert cache.token_to_kv_pool_allocator.available_size() == POOL - T  # the original only
    assert not cache.beta_store.compacted[1:].any()
    assert (cache.beta_store.beta[:, 1:] == 0).all()
    with pytest.raises(ValueError, match=why):
        cache.install(ids, tampered(prefix, name, fn))
    check_accounting(cache)
    # the original still serves the whole prefix
    assert cache.match_prefix(MatchPrefixParams(key=key(ids))).device_prefix_len == T


def test_the_real_result_passes_the_checks_in_an_fp16_pool(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp, dtype=torch.float16)
    insert_fresh(cache, ids)
    node = cache.install(ids, prefix)
    assert cache.match_prefix(MatchPrefixParams(key=key([*ids, 3]))).last_device_node is node


def test_slack_leaves_room_over_the_measured_magnitudes() -> None:
    """The range checks' constants against benchmarks/server/magnitudes.py's figures: at least 2x
    headroom over what real methods produced on the embedded model."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "magnitudes.json").read_text())
    assert 2 * measured["max_key_ratio"] <= KEY_SLACK
    assert 2 * measured["max_value_ratio"] <= VALUE_SLACK
    assert 2 * max(measured["max_beta_minus_ln_T"], 1.0) <= BETA_SLACK


def test_install_reports_the_budget_the_compactor_chose(compacted: Any, caplog: Any) -> None:
    """A target-error search's chosen ratio and estimate reach the log and the gauges; a fixed
    ratio is reported as such, with no estimate."""
    import dataclasses
    import logging

    ids, prefix, fp = compacted
    searched = dataclasses.replace(
        prefix,
        budget=dataclasses.replace(
            prefix.budget,
            ratio_asked=None,
            ratio_chosen=0.2,
            target_error=0.15,
            estimated_error=0.12,
        ),
    )
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    with caplog.at_level(logging.INFO, logger="sglang_ext"):
        cache.install(ids, searched)
    assert (cache.stats.chosen_ratio, cache.stats.estimated_error) == (0.2, 0.12)
    assert "ratio=0.2 estimated_error=0.12" in caplog.text
    fixed = make_cache(fp)
    insert_fresh(fixed, ids)
    fixed.install(ids, prefix)
    assert fixed.stats.chosen_ratio == prefix.budget.ratio_asked > 0
    assert fixed.stats.estimated_error == 0.0


def test_install_without_the_original_is_refused(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    with pytest.raises(ValueError, match="no longer cached"):
        cache.install(ids, prefix)
    assert cache.token_to_kv_pool_allocator.available_size() == POOL


def test_install_is_spread_over_scheduler_iterations(compacted: Any) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, install_chunk_mb=1, install_step_ms=1e9)
    insert_fresh(cache, ids)
    counts = head_counts(prefix)
    n_slots = slots_needed(counts)
    per_layer = 2 * math.ceil(int(counts.sum()) / prefix.num_layers) * 64 * 4  # K and V, fp32
    per_poll = max(1, (1 << 20) // per_layer)
    polls = math.ceil(prefix.num_layers / per_poll)
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    for _ in range(polls - 1):
        assert cache.poll_compactions() == 0
        assert not cache.compacted_nodes()  # not matchable while half written
        check_accounting(cache)  # SGLang's idle leak check: pending slots count as protected
        assert cache.protected_size() == n_slots
        assert cache.match_prefix(MatchPrefixParams(key=key([*ids, 3]))).device_prefix_len == T
    assert cache.poll_compactions() == 1
    assert cache.stats.installed == 1
    check_accounting(cache)


def test_install_time_budget_spreads_it_one_layer_per_iteration(compacted: Any) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, install_step_ms=1e-6)  # over budget after a layer
    insert_fresh(cache, ids)
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    polls = [cache.poll_compactions() for _ in range(prefix.num_layers)]
    assert polls == [0] * (prefix.num_layers - 1) + [1]
    check_accounting(cache)


def test_an_idle_scheduler_writes_the_install_whole(compacted: Any) -> None:
    """The budgets spread an install only while requests run: an idle poll (no request runs
    or waits) writes every layer at once, where the busy polls above take one each."""
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, install_chunk_mb=1, install_step_ms=1e-6)
    insert_fresh(cache, ids)
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    assert cache.poll_compactions(idle=False) == 0  # busy: one layer
    assert cache.lifecycle.pending[0].next_layer == 1
    assert cache.poll_compactions(idle=True) == 1  # idle: the rest, and the node
    assert cache.stats.installed == 1 and len(cache.compacted_nodes()) == 1
    check_accounting(cache)


def test_the_poll_hook_asks_the_scheduler_whether_it_is_idle() -> None:
    from sglang_ext.adapter import hooks

    seen: list[bool] = []

    def poll(idle: bool = False) -> int:
        seen.append(idle)
        return 0

    cache = SimpleNamespace(guard=HookGuard(lambda why: None), poll_compactions=poll)
    for idle in (True, False):
        scheduler = SimpleNamespace(tree_cache=cache, is_fully_idle=lambda idle=idle: idle)
        hooks._poll_scheduler(None, scheduler)
    assert seen == [True, False]


def test_pending_step_writes_at_least_one_layer(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    p = cache.lifecycle.begin(ids, prefix)
    assert isinstance(p, PendingInstall)
    assert p.step(cache.kvcache, cache.beta_store, max_bytes=1) == p.layer_bytes(cache.kvcache)
    assert p.next_layer == 1 and not p.done


def test_back_pressure_defers_new_paths_while_results_are_pending(compacted: Any) -> None:
    ids, _prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2, max_in_flight=1)
    runner.pending = 1  # one compaction already in flight
    for rid, extra, n in (("a", [501, 502], 0), ("b", [601, 602], T)):
        r = make_req(cache, rid, [*ids, *extra], n)
        cache.checkpoint(r, up_to=T + 2)
        release_req(cache, r, T + 2)
    assert runner.submitted == [] and cache.stats.deferred == 1
    runner.pending = 0  # it finished: the next hit sends the path
    r = make_req(cache, "c", [*ids, 701], T)
    cache.checkpoint(r, up_to=T + 1)
    release_req(cache, r, T + 1)
    assert [tokens for tokens, _ in runner.submitted] == [ids]


def test_weight_update_drops_compacted_prefixes_and_stale_results(compacted: Any) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner)
    insert_fresh(cache, ids)
    node = cache.install(ids, prefix)
    slots = node.compaction.slots.clone()
    running = make_req(cache, "running", [*ids, 9, 9], T)  # a request on the compacted prefix
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1, epoch=0))

    cache.on_weights_updated(fp)
    assert runner.epoch == 1
    assert cache.match_prefix(MatchPrefixParams(key=key([*ids, 3]))).device_prefix_len == 0
    cache.poll_compactions()  # the result computed for the old weights
    assert cache.stats.stale == 1 and cache.stats.installed == 1
    assert not cache.compacted_nodes()
    assert cache.token_to_kv_pool_allocator.available_size() < POOL  # still held by the request
    cache.checkpoint(running, up_to=T + 2)  # computed on old weights: kept off the tree
    assert cache.stats.skipped_checkpoints == 1
    release_req(cache, running, T + 2)
    cache.poll_compactions()
    assert cache.token_to_kv_pool_allocator.available_size() == POOL
    assert not cache.beta_store.compacted[slots].any()
    check_accounting(cache)

    cache.on_weights_updated(None)  # weights no service holds: compaction off
    insert_fresh(cache, ids)
    with pytest.raises(ValueError, match="weights were updated"):
        cache.install(ids, prefix)


def test_weights_fingerprint_continues_only_for_the_same_checkpoint(
    compacted: Any, prepared_model: Any
) -> None:
    _, _, fp = compacted
    ok = SimpleNamespace(success=True)
    same = SimpleNamespace(model_path=str(prepared_model))
    assert weights_fingerprint(fp, ok, same) == fp
    assert weights_fingerprint(fp, SimpleNamespace(success=False), same) is None
    assert weights_fingerprint(fp, ok, SimpleNamespace(serialized_named_tensors=[])) is None
    assert weights_fingerprint(fp, ok, SimpleNamespace(model_path="/nonexistent")) is None
    assert weights_fingerprint("0" * 32, ok, same) is None


def test_runner_checks_results_on_its_own_thread(compacted: Any) -> None:
    _, prefix, _ = compacted
    seen: list[str] = []

    class Instant:
        async def compact_prefix(
            self, token_ids: Any, follow_ups: Any, fit_round: int = 0
        ) -> CompactedPrefix:
            await asyncio.sleep(0)
            return prefix

    def check(p: CompactedPrefix) -> None:
        import threading

        seen.append(threading.current_thread().name)
        raise ValueError("shape mismatch")

    runner = CompactionRunner(Instant(), timeout=10, check=check)
    try:
        runner.submit([1, 2, 3], [])
        assert runner.wait_idle(10)
        (job,) = runner.drain()
        assert job.prefix is None and isinstance(job.error, ValueError)
        assert seen == ["compaction-runner"]
        runner.new_epoch()
        runner.check = None
        runner.submit([1, 2, 3], [])
        assert runner.wait_idle(10)
        (job,) = runner.drain()
        assert job.prefix is prefix and job.epoch == 1
    finally:
        runner.close()


def test_an_identity_fit_installs_with_every_slot_and_the_original_kv(
    compacted: Any, prepared_model: Path
) -> None:
    """keep-only of am-highest at ratio 1 (every key, beta 0, original values): N = T slots, no
    alias, and the pool holds the original KV again (what the GPU identity check installs:
    benchmarks/gpu/serving/run.py)."""
    from compactor.hf import load_model
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec, QueryConfig
    from tests.sglang_ext._radix import ORIGINAL_KV

    ids, _, fp = compacted
    model, tok = load_model(prepared_model)
    spec = CompactionSpec(
        method="keep-only",
        method_params={"inner": "am-highest"},
        ratio=1.0,
        queries=QueryConfig(sources=("context-prefill",)),
    )
    identity, _ = compact_prefix(model, tok, ids, spec, hooks=Hooks(progress=False))
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    node = cache.install(ids, identity)
    order = identity.layers[0].kept_indices[:T]  # the kept token of each slot (one order)
    assert sorted(order.tolist()) == list(range(T))
    slots = node.compaction.slots[torch.argsort(order)]  # slot of token 0, 1, ...
    assert node.compaction.num_slots == T and len(node.value) == T and 0 not in node.value.tolist()
    for i, (k, v) in enumerate(ORIGINAL_KV[tuple(ids)]):
        assert torch.allclose(cache.kvcache.get_key_buffer(i)[slots], k, atol=1e-6)
        assert torch.allclose(cache.kvcache.get_value_buffer(i)[slots], v, atol=1e-6)
        assert (cache.beta_store.beta[i, slots] == 0).all()
    check_accounting(cache)


def test_each_layer_reaches_its_check_and_the_pool_on_the_pools_device(compacted: Any) -> None:
    """A result arrives on the host and the pool lives on the accelerator. Here the pool is on
    the meta device (a device other than the result's, as CUDA is on a GPU machine): `check`
    must see K, V and beta there, or its one `torch.stack` raises, as it did on an H100 when
    beta stayed on the host (benchmarks/results/gpu_runs/2026-11-26-h100-2/)."""
    from sglang_ext.kv_store import BetaStore, write_layers

    _, prefix, _ = compacted
    L, H, D = prefix.num_layers, prefix.num_kv_heads, prefix.head_dim
    S = 4 * T
    bufs = [
        (torch.empty(S, H, D, device="meta"), torch.empty(S, H, D, device="meta")) for _ in range(L)
    ]
    pool = SimpleNamespace(
        start_layer=0,
        layer_num=L,
        get_key_buffer=lambda i: bufs[i][0],
        get_value_buffer=lambda i: bufs[i][1],
    )
    store = BetaStore(L, S, H, "meta")
    seen: list[tuple[int, set[str]]] = []

    def check(i: int, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> None:
        seen.append((i, {t.device.type for t in (k, v, beta)}))
        torch.stack([k.abs().amax().float(), v.abs().amax().float(), beta.amax().float()])

    counts = head_counts(prefix)
    layout = PackedLayout(counts, torch.arange(1, 1 + slots_needed(counts)), T)
    write_layers(pool, store, prefix, layout, check=check)
    assert seen == [(i, {"meta"}) for i in range(L)]
    assert store.prefix_of(1) is layout


def test_a_compacted_node_holds_its_slots_on_the_pools_device() -> None:
    """SGLang's allocator hands out slots on the pool's device and concatenates node values
    along a path: the alias slots of a compacted node must be there too (on a GPU they were
    made on the host, and `torch.cat` raised at the end of every install)."""
    from sglang.srt.mem_cache.radix_cache import TreeNode

    from sglang_ext.adapter.compacted_node import new_compacted_node
    from sglang_ext.prefix_tree import CompactionInfo

    slots = torch.arange(1, 5, device="meta")
    layout = PackedLayout(torch.full((2, 2), 4), slots, 16)
    node = new_compacted_node(TreeNode(), list(range(16)), CompactionInfo(layout, "h", "m", 0))
    assert node.value.device.type == "meta" and node.value.shape == (16,)


def test_a_reinstall_beside_a_dropped_node_stays_in_the_tree(compacted: Any) -> None:
    """The same checkpoint reloaded keeps compaction on; a request still reads the dropped
    node when the same prefix is installed again (same prefix hash and fit round, so the same
    child key under the root). Freeing the old node must not unhook the new one."""
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    old = cache.install(ids, prefix)
    running = make_req(cache, "running", [*ids, 9, 9], T)
    cache.on_weights_updated(fp)
    insert_fresh(cache, ids)
    new = cache.install(ids, prefix)
    assert new is not old and cache.compacted_nodes() == [new]
    release_req(cache, running, T + 2)
    cache.poll_compactions()  # the dropped node's last request ended: it is freed
    assert new in cache.root_node.children.values()
    assert old not in cache.root_node.children.values()
    assert cache.match_prefix(MatchPrefixParams(key=key([*ids, 3]))).device_prefix_len == T
    check_accounting(cache)
