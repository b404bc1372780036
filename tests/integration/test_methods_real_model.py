"""gvote / compresskv / baselines on the real SmolLM2-135M (short prefixes, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compactor import hf
from compactor.methods import LayerInput, get_method
from compactor.methods.context import build_layer_contexts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def loaded(prepared_model: Path):
    torch.set_num_threads(1)
    model, tok = hf.load_model(prepared_model)
    from compactor.eval.niah import make_niah

    case = make_niah(tok, 256, "single", seed=1)
    ids = tok(case.prefix, add_special_tokens=False)["input_ids"]
    pre = hf.prefill(model, ids, with_queries=True)
    return model, tok, ids, pre, prepared_model


def test_layer_contexts_reproduce_the_model_queries(loaded) -> None:
    model, _, ids, pre, model_dir = loaded
    ctxs = build_layer_contexts(model, ids, model_dir=str(model_dir))
    assert len(ctxs) == 30 and ctxs[0].hidden.shape == (len(ids), 576)
    for li in (0, 17, 29):
        torch.testing.assert_close(
            ctxs[li].last_query, pre.queries[li][:, -1], atol=1e-4, rtol=1e-4
        )


def test_gvote_and_baselines_on_real_layers(loaded) -> None:
    model, _, ids, pre, model_dir = loaded
    ctxs = build_layer_contexts(model, ids, model_dir=str(model_dir))
    T = len(ids)
    fit = hf.pool_gqa(pre.queries[12][:, -64:-8], 3)
    k, v = pre.keys[12], pre.values[12]
    g = get_method("gvote")
    layer, report = g.compact(LayerInput(k, v, fit, (T,) * 3, context=ctxs[12]))
    lens = layer.head_lengths()
    assert lens == report["kept_per_kv_head"] and 0 < sum(lens) <= 3 * T
    b = max(1, T // 10)
    for name in ("snapkv", "h2o", "streamingllm", "kvzip", "kvcompose"):
        out = get_method(name).compact_layer(k, v, fit, [b] * 3)
        assert sum(out.head_lengths()) == 3 * b
        assert torch.isfinite(out.values).all()
    am = get_method("snapkv", refit="am").compact_layer(k, v, fit, [b] * 3)
    assert torch.isfinite(am.beta).all()


def test_compresskv_calibration_and_selection(loaded, tmp_path: Path) -> None:
    from compactor.eval.compresskv_calibration import calibrate_compresskv

    model, tok, ids, pre, _ = loaded
    data = calibrate_compresskv(model, tok, num_cases=2, num_tokens=192)
    assert data["correct_value_tokens"] > 0
    srh = torch.tensor(data["srh_scores"])
    assert srh.shape == (30, 9) and float(srh.max()) > 0.3  # real retrieval heads exist
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    m = get_method("compresskv", calibration=str(path))
    ctxs = build_layer_contexts(model, ids)
    q = hf.pool_gqa(pre.queries[20][:, -32:], 3)
    sel = m.select(pre.keys[20], pre.values[20], q, [20] * 3, context=ctxs[20])
    rows = [r.tolist() for r in sel.per_head()]
    assert rows[0] == rows[1] == rows[2]


KVPRESS_PY = ROOT / "third_party" / ".kvpress-venv" / "bin" / "python"
_BUILD = "`bash scripts/setup_kvpress_venv.sh` builds it (`make test` runs that first)"


@pytest.mark.peer
def test_kvpress_crosscheck(tmp_path: Path, prepared_model: Path) -> None:
    """Our snapkv / streamingllm / kvcompose keep what NVIDIA kvpress keeps (its own venv)."""
    if not KVPRESS_PY.exists():
        pytest.fail(f"kvpress venv missing ({KVPRESS_PY}); {_BUILD}", pytrace=False)
    probe = subprocess.run(
        [str(KVPRESS_PY), "-c", "import kvpress, torch, transformers"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        pytest.fail(
            f"kvpress venv broken ({KVPRESS_PY}); {_BUILD}\n{probe.stderr[-2000:]}",
            pytrace=False,
        )
    out = tmp_path / "x.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.offline.kvpress_crosscheck",
            "--tokens",
            "200",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"kvpress_crosscheck.py failed:\n{run.stderr[-4000:]}"
    res = json.loads(out.read_text())
    assert res["snapkv"]["mean_jaccard"] == 1.0
    assert res["streamingllm"]["mean_jaccard"] == 1.0
    assert res["kvcompose"]["mean_jaccard_kvpress_normalization"] == 1.0
