"""Non-uniform per-(layer, KV head) budgets end to end: pipeline, sensitivity, CLI, service job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compactor import hf
from compactor.cli import main
from compactor.eval.harness import EvalCase
from compactor.eval.sensitivity import measure_sensitivity
from compactor.head_budgets.curves import (
    SensitivityCurves,
    load_sensitivity_json,
    save_sensitivity_json,
    sensitivity_path,
)
from compactor.pipeline import Hooks, compact_prefix
from compactor.spec import CompactionSpec, QueryConfig
from compactor.types import CompactedPrefix
from compactor.workers.errors import InvalidRequest
from compactor.workers.job import CompactJob
from tests._tiny import random_ids, tiny_llama

SRC = ("repeat-prefill",)
SPEC = CompactionSpec(method="am-highest", ratio=0.25, queries=QueryConfig(sources=SRC))
FR = [0.1, 0.25, 0.5]
STEEP = [0.9, 0.6, 0.3]  # a sensitive head: error falls fast with more budget
FLAT = [0.02, 0.015, 0.01]


@pytest.fixture(scope="module")
def tiny(tiny):
    """The shared tiny model, with torch set to one thread (as this module always ran)."""
    torch.set_num_threads(1)
    return tiny


@pytest.fixture(scope="module")
def tiny_dir_with_tokenizer(tmp_path_factory) -> Path:
    """The tiny model plus a character-level tokenizer (98 of its 128 ids), saved together."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-tok")
    tiny_llama(path)
    chars = ["\n"] + [chr(i) for i in range(32, 127)]
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return path


def _run(model, ids, model_fingerprint=None, **kw):
    hooks = Hooks(progress=False, model_fingerprint=model_fingerprint)
    prefix, _ = compact_prefix(model, None, ids, SPEC.replace(**kw), hooks=hooks)
    return prefix


def _saved(curves: SensitivityCurves, path: Path) -> str:
    """`curves` written to `path` (a spec names its curves by file)."""
    save_sensitivity_json(path, curves)
    return str(path)


def _same_tensors(a: CompactedPrefix, b: CompactedPrefix) -> bool:
    return all(
        torch.equal(x, y)
        for la, lb in zip(a.layers, b.layers, strict=True)
        for x, y in (
            (la.keys, lb.keys),
            (la.values, lb.values),
            (la.beta, lb.beta),
            (la.indptr, lb.indptr),
            (la.kept_indices, lb.kept_indices),
        )
    )


def test_uniform_default_unchanged_and_flat_curves_reproduce_it(tiny, tmp_path):
    ids = random_ids(48)
    assert SPEC.head_budgets == "uniform"
    base = _run(tiny, ids)  # the spec's default head budgets
    assert base.budget.per_head == "uniform" and base.budget.head_table is None
    assert _same_tensors(base, _run(tiny, ids, head_budgets="uniform"))
    # identical curves for every head: the greedy swap moves nothing -> the uniform split
    flat = SensitivityCurves(FR, [[STEEP, STEEP], [STEEP, STEEP]], method="am-highest")
    same = _run(tiny, ids, head_budgets=_saved(flat, tmp_path / "flat.json"))
    assert same.budget.per_head == "sensitivity"
    assert same.budget.head_table == [[12, 12], [12, 12]] == base.kept_per_head()
    assert _same_tensors(base, same)


def test_sensitive_head_gets_more_with_the_same_total(tiny, tmp_path):
    ids = random_ids(48, seed=1)  # T=48, s=4, budget 12 per head (8 non-sink), total 48
    curves = SensitivityCurves(FR, [[FLAT, FLAT], [STEEP, FLAT]], method="am-highest")
    uni = _run(tiny, ids)
    path = _saved(curves, tmp_path / "c.json")
    pre = _run(tiny, ids, head_budgets=path)
    kept = pre.kept_per_head()
    assert kept[1][0] > 12 and all(kept[li][h] < 12 for li, h in ((0, 0), (0, 1), (1, 1)))
    assert min(min(r) for r in kept) >= 4 + 1  # sinks + at least one entry
    assert pre.kept_tokens() == uni.kept_tokens() == 4 * 12
    assert pre.budget.head_table == kept
    assert pre.budget.head_source == path
    # the ragged layout decodes (padded per layer) and logits stay finite
    logits = hf.PrefixState.from_compacted(pre).forward(tiny, random_ids(5, seed=9))
    assert logits.shape == (5, 128) and bool(torch.isfinite(logits).all())


def test_auto_reads_the_model_dir_file(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "compactor_model_dir", str(tmp_path))
    ids = random_ids(40, seed=2)
    with pytest.raises(ValueError, match="compactor sensitivity --model") as info:
        _run(tiny, ids, head_budgets="auto", model_fingerprint="fp")
    assert str(sensitivity_path(tmp_path, "am-highest")) in str(info.value)
    curves = SensitivityCurves(FR, [[STEEP, FLAT], [FLAT, FLAT]], method="am-highest")
    save_sensitivity_json(sensitivity_path(tmp_path, "am-highest"), curves)
    a = _run(tiny, ids, head_budgets="auto", model_fingerprint="fp")
    copy = _saved(curves, tmp_path / "copy.json")
    b = _run(tiny, ids, head_budgets=copy, model_fingerprint="fp")
    assert a.budget.head_source == str(sensitivity_path(tmp_path, "am-highest"))
    assert _same_tensors(a, b) and a.kept_per_head()[0][0] > a.kept_per_head()[0][1]


@pytest.mark.parametrize(
    ("curves", "kwargs", "match"),
    [
        ([[FLAT, FLAT]] * 3, {}, r"\(3, 2\), the model has \(2, 2\)"),
        ([[FLAT, FLAT, FLAT]] * 2, {}, r"\(2, 3\), the model has \(2, 2\)"),
        ([[FLAT, FLAT]] * 2, {"chunk_size": 10}, r"chunk_size=10 splits the 36 .* 4 chunks"),
        ([[FLAT, FLAT]] * 2, {"method": "kvcompose"}, "kvcompose.*plans its own"),
        ([[FLAT, FLAT]] * 2, {"meta": {"model_fingerprint": "other"}}, "measured on model 'other'"),
    ],
)
def test_bad_curves_or_combinations(tiny, tmp_path, curves, kwargs, match):
    c = SensitivityCurves(FR, curves, meta=kwargs.pop("meta", {}))
    spec = SPEC.replace(head_budgets=_saved(c, tmp_path / "c.json"), **kwargs)
    with pytest.raises(ValueError, match=match):
        compact_prefix(tiny, None, random_ids(40), spec, hooks=Hooks(progress=False))


def test_missing_curves_file_names_it(tiny, tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=f"no sensitivity curves at {missing}"):
        _run(tiny, random_ids(40), head_budgets=str(missing))


def test_measure_sensitivity_core(tiny, tmp_path):
    case = EvalCase("rand", random_ids(64, seed=3), [random_ids(6, seed=4), random_ids(5, seed=5)])
    fit = CompactionSpec(method="am-highest", queries=QueryConfig(sources=SRC))
    curves = measure_sensitivity(
        tiny, None, case, fit, [0.1, 0.5, 1.0], answer_tokens=3, progress=False
    )
    assert curves.shape == (2, 2, 3) and curves.method == "am-highest"
    for layer in curves.errors:
        for row in layer:
            assert row[0] > row[-1] and row[-1] < 0.05  # everything kept: (nearly) exact
    assert curves.meta["T"] == 64 and curves.meta["fit_query_sources"] == ["repeat-prefill"]
    assert curves.meta["eval_queries_per_head"] == 2 * (6 + 3 + 5 + 3)  # G=2, held-out answers
    path = tmp_path / "c.json"
    save_sensitivity_json(path, curves)
    assert load_sensitivity_json(path) == curves
    prefix = _run(tiny, case.prefix_ids, head_budgets=str(path))  # fingerprint matches
    assert prefix.budget.per_head == "sensitivity"
    with pytest.raises(ValueError, match="per-layer context"):
        measure_sensitivity(tiny, None, case, fit.replace(method="gvote"), progress=False)
    with pytest.raises(ValueError, match="increasing"):
        measure_sensitivity(tiny, None, case, fit, [0.5, 0.1], progress=False)


def test_cli_sensitivity_then_compact_and_eval_auto(tiny_dir_with_tokenizer, tmp_path, capsys):
    d = str(tiny_dir_with_tokenizer)
    argv = ["sensitivity", "--model", d, "--tokens", "160", "--fractions", "0.25,0.5"]
    assert main([*argv, "--answer-tokens", "2", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    path = sensitivity_path(d, "am-highest")
    assert out["path"] == str(path) and out["shape"] == [2, 2, 2]
    curves = load_sensitivity_json(path)
    assert curves.shape == (2, 2, 2) and curves.meta["T"] <= 160

    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper of the north light is Anna. She counts ships. " * 2)
    common = ["--model", d, "--input", str(doc), "--query-sources", "repeat-prefill"]
    res = tmp_path / "p.safetensors"
    compact = ["compact", *common, "--ratio", "0.3", "--output", str(res), "--no-progress"]
    assert main([*compact, "--method", "am-highest", "--head-budgets", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["head_budgets"] == "sensitivity"
    assert CompactedPrefix.load(res).budget.head_source == str(path)
    # no curves for am-omp-fast: a clear error and exit code 2, nothing written
    assert main([*compact, "--method", "am-omp-fast", "--head-budgets", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"compactor sensitivity --model {d} --method am-omp-fast" in err

    js = tmp_path / "e.json"
    ev = ["eval", *common, "--ratios", "0.3", "--answer-tokens", "2", "--json", str(js)]
    methods = "am-highest,am-highest:head_budgets=auto"
    assert main([*ev, "--methods", methods, "--no-progress"]) == 0
    recs = json.loads(js.read_text())["records"]
    assert [r["head_budgets"] for r in recs] == ["uniform", "sensitivity"]
    assert recs[0]["kept_tokens"] == recs[1]["kept_tokens"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--model", "no-such-model"], "neither a known model"),
        (["--method", "no-such-method"], "unknown method 'no-such-method'; available: "),
        (["--fractions", "0.5,0.1"], "increasing"),
    ],
)
def test_cli_sensitivity_errors_exit_2(tiny_dir_with_tokenizer, capsys, argv, match):
    base = {"--model": str(tiny_dir_with_tokenizer), "--tokens": "96", "--answer-tokens": "1"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    assert main(["sensitivity", *[x for kv in base.items() for x in kv], "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compactor sensitivity: error:") and match in err


def test_cli_sensitivity_without_tokenizer_exit_2(tiny, capsys):
    assert main(["sensitivity", "--model", tiny.compactor_model_dir, "--no-progress"]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_compact_job_head_budgets_field():
    auto = SPEC.replace(head_budgets="auto")
    job = CompactJob("fp", (1, 2, 3), auto)
    job.validate(max_prefix_tokens=100)
    assert job.key() != CompactJob("fp", (1, 2, 3), SPEC).key()
    with pytest.raises(InvalidRequest, match="head_budgets must be one of"):
        CompactJob("fp", (1, 2, 3), SPEC.replace(head_budgets="/etc/x.json")).validate(100)
    # a head budget is not a method parameter any more
    bad = SPEC.replace(method_params={"head_budgets": "auto"})
    with pytest.raises(InvalidRequest, match="head_budgets is not a parameter a request may set"):
        CompactJob("fp", (1, 2, 3), bad).validate(100)


def test_worker_auto_without_curves_is_invalid_request(tiny, tmp_path, monkeypatch):
    from compactor.workers.worker import run_compaction

    monkeypatch.setattr(tiny, "compactor_model_dir", str(tmp_path))
    job = CompactJob("fp", tuple(random_ids(30)), SPEC.replace(ratio=0.3, head_budgets="auto"))
    with pytest.raises(InvalidRequest, match="no sensitivity curves"):
        run_compaction(tiny, None, "fp", job)
    curves = SensitivityCurves(FR, [[STEEP, FLAT], [FLAT, FLAT]], method="am-highest")
    save_sensitivity_json(sensitivity_path(tmp_path, "am-highest"), curves)
    res = run_compaction(tiny, None, "fp", job)
    assert res.prefix.budget.per_head == "sensitivity"
    assert res.prefix.kept_per_head()[0][0] > res.prefix.kept_per_head()[0][1]
