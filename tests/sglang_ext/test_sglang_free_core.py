"""The plugin's core imports no SGLang: only `sglang_ext/adapter/` may.

(a) an AST scan of every module outside the adapter; (b) a subprocess in which importing
`sglang` fails imports every core module and drives the compacted-prefix state machine
(`InstallLifecycle`) through pending -> installed -> superseded / dropped / retired, and a
failed write, over a tree of dicts (`DictTree`), alone and with the TP strategy (`TpSync`).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sglang_ext"
ADAPTER = PACKAGE / "adapter"


def _core_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if ADAPTER not in p.parents)


def _sglang_imports(path: Path) -> list[str]:
    """Every `import sglang...` / `from sglang... import` in `path`, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "sglang"]
    return found


def test_no_core_module_imports_sglang() -> None:
    modules = _core_modules()
    assert len(modules) >= 15 and PACKAGE / "lifecycle.py" in modules
    assert [hit for path in modules for hit in _sglang_imports(path)] == []


def test_the_scan_finds_an_sglang_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from sglang.srt import x\n    import sglang\n")
    assert len(_sglang_imports(bad)) == 2


SCRIPT = r"""
import importlib, json, sys
from pathlib import Path

class NoSGLang:
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, NoSGLang())
root = Path(sys.argv[1])
mods = sorted(
    ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    for p in (root / "sglang_ext").rglob("*.py") if "adapter" not in p.parts
)
for m in mods:
    importlib.import_module(m)
try:
    import sglang  # noqa: F401
    blocked = False
except ImportError:
    blocked = True

import torch
from compactor.types import CompactedLayer, CompactedPrefix, prefix_hash
from sglang_ext.pool_shape import PoolShape
from sglang_ext.runner import JobResult
from sglang_ext.config import CompactionConfig
from sglang_ext.kv_store import BetaStore
from sglang_ext.lifecycle import InstallLifecycle
from sglang_ext.prefix_tree import CompactionInfo
from sglang_ext.tp import TpSync

L, H, D, S = 2, 2, 4, 64

class Pool:  # what the core reads of a KV pool
    start_layer, layer_num = 0, L
    def __init__(self):
        self.k = [torch.randn(S, H, D) for _ in range(L)]
        self.v = [torch.randn(S, H, D) for _ in range(L)]
    def get_key_buffer(self, i): return self.k[i]
    def get_value_buffer(self, i): return self.v[i]

class Node:
    def __init__(self, ids, info=None):
        self.ids, self.info, self.children, self.locks = ids, info, [], 0

class DictTree:  # TreeOps over plain objects
    def __init__(self):
        self.free_slots = list(range(1, S))
        self.protected = self.evictable = 0
        self.nodes = []  # attached
        self.freed = []
    def alloc(self, n):
        if len(self.free_slots) < n: raise RuntimeError("full")
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)
    def free(self, slots): self.free_slots += slots.tolist()
    def hold(self, n): self.protected += n
    def slot_counts(self): return self.protected + self.evictable, len(self.free_slots), S
    def original_slots(self, ids): return torch.arange(S - len(ids), S)  # its KV: randn
    def add_node(self, ids, info):
        node = Node(ids, info); self.nodes.append(node)
        self.protected -= info.num_slots; self.evictable += info.num_slots
        return node
    def original_path(self, ids):
        path = Node(ids); self.nodes.append(path); return [path]
    def descendants(self, node): return list(node.children)
    def info(self, node): return node.info
    def attached(self, node): return node in self.nodes
    def unlocked_leaf(self, node): return node.locks == 0 and not node.children
    def free_node(self, node):  # as the adapter: the lifecycle hears of a compacted node
        if node.info: self.free(node.info.slots); self.lc.freeing(node, node.info)
        self.nodes.remove(node); self.freed.append(node)
        if node.info: self.lc.removed(node, node.info)
        return node.info.num_slots if node.info else len(node.ids)

def prefix(ids, keep, fp="fp", scale=1.0):
    T = len(ids)
    layers = []
    for _ in range(L):
        n = H * keep
        layers.append(CompactedLayer(torch.randn(n, D) * 0.1 * scale, torch.randn(n, D) * 0.1,
                                     torch.zeros(n), torch.arange(0, n + 1, keep, dtype=torch.int32)))
    return CompactedPrefix(model_fingerprint=fp, logical_length=T, prefix_hash=prefix_hash(ids),
                           method="am-highest", params={"ratio": keep / T}, layers=layers,
                           head_dim=D, num_kv_heads=H, dtype=torch.float32)

class Runner:  # what the core uses of a CompactionRunner
    epoch, pending, check = 0, 0, None
    def __init__(self): self.done = []
    def drain(self): out, self.done = self.done, []; return out
    def new_epoch(self): self.epoch += 1; return self.epoch
    def submit(self, *a, **k): pass

def job(ids, pfx, fit_round=0, epoch=0, job_id=0, error=None):
    return JobResult(job_id=job_id, token_ids=tuple(ids), prefix=pfx, error=error,
                     latency_s=0.01, epoch=epoch, fit_round=fit_round)

def lifecycle(tp=None):
    pool, tree, runner = Pool(), DictTree(), Runner()
    # one poll writes a whole result, however busy the machine (as tests/sglang_ext/_radix.py)
    cfg = CompactionConfig(endpoint="inproc://", min_prefix_tokens=4, install_step_ms=1e9)
    lc = InstallLifecycle(tree, cfg, "fp", pool, BetaStore.of_pool(pool), PoolShape.of(pool),
                          runner=runner, tp=tp)
    tree.lc = lc
    return lc, tree, runner

out = {"blocked": blocked, "modules": len(mods)}
ids = list(range(100, 116))

# pending -> installed (original path retired and freed), superseded by a refit, dropped
lc, tree, runner = lifecycle()
runner.done.append(job(ids, prefix(ids, 4)))
lc.poll()
out["after_first_poll"] = [len(lc.pending), len(lc.installed)]
while lc.pending:
    lc.poll()
first = lc.installed[prefix_hash(ids)]
out["installed"] = [first.info.num_slots, first.info.fit_round, lc.stats.installed]
out["retired_freed"] = [n.info is None for n in tree.freed]
out["beta_slots"] = int(lc.beta_store.compacted[first.info.slots].sum())
first.locks = 1  # a request still reads the first fit
runner.done.append(job(ids, prefix(ids, 3), fit_round=1))
while runner.done or lc.pending:
    lc.poll()
second = lc.installed[prefix_hash(ids)]
out["superseded"] = [second is not first, second.info.fit_round, first in tree.nodes]
first.locks = 0
lc.poll()
out["superseded_freed"] = [first in tree.nodes, bool(lc.beta_store.compacted[first.info.slots].any())]
second.locks = 1
lc.on_weights_updated(None)
out["dropped"] = [len(lc.installed), len(lc.dropped), second in tree.nodes, lc.fingerprint]
second.locks = 0
lc.poll()
out["dropped_freed"] = [second in tree.nodes, len(lc.dropped)]

# a write that fails its magnitude check: slots back, nothing installed
lc, tree, runner = lifecycle()
free0 = len(tree.free_slots)
runner.done.append(job(ids, prefix(ids, 4, scale=1e30)))
for _ in range(4):
    lc.poll()
out["bad_write"] = [len(lc.installed), len(lc.pending), len(tree.free_slots) == free0,
                    tree.protected, lc.stats.invalid]

# a stale result and a wrong fingerprint are refused
lc, tree, runner = lifecycle()
runner.done += [job(ids, prefix(ids, 4), epoch=7), job(ids, prefix(ids, 4, fp="other"))]
lc.poll()
out["refused"] = [lc.stats.stale, lc.stats.invalid, len(lc.installed)]

# the TP strategy (one rank, its exchange in-process): a job starts and becomes a node only
# at agreed polls
lc, tree, runner = lifecycle(TpSync(None, 0, 1, exchange_fn=lambda r: [r]))
lc.tp.on_submit(5, ids, [])
runner.done.append(job(ids, prefix(ids, 4), job_id=5))
steps = 0
while not lc.installed and steps < 10:
    lc.poll(); steps += 1
out["tp"] = [len(lc.installed), lc.tp.polls >= 2, lc.tp.held, len(lc.pending)]
print(json.dumps(out))
"""


def test_core_runs_without_sglang() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["blocked"] is True and out["modules"] >= 15
    assert out["after_first_poll"] == [0, 1]  # a small result is written within one poll
    assert out["installed"] == [4, 0, 1]
    assert out["retired_freed"] == [True]  # the original path, freed at install
    assert out["beta_slots"] == 4
    assert out["superseded"] == [True, 1, True]  # locked: kept until its request lets go
    assert out["superseded_freed"] == [False, False]
    assert out["dropped"] == [0, 1, True, None]
    assert out["dropped_freed"] == [False, 0]
    assert out["bad_write"] == [0, 0, True, 0, 1]
    assert out["refused"] == [1, 1, 0]
    assert out["tp"] == [1, True, 0, 0]
