"""A hostile spec is refused before any work, with the field named: every method's every
numeric parameter at 10^9, a float where an int belongs, parameters a request may not set,
nested parameters, and megabytes of self-study prompts (`compactor.spec.method_limits`,
`WorkLimits`). The service answers these with INVALID_ARGUMENT (its test: service/)."""

from __future__ import annotations

import dataclasses

import pytest

from compactor.methods import METHODS, method_class
from compactor.spec import CompactionSpec, QueryConfig
from compactor.spec.method_limits import METHOD_PARAMS, Caps, check_method_params
from compactor.workers.errors import InvalidRequest
from compactor.workers.job import CompactJob

T = 64
# every numeric parameter but a seed (any 31-bit seed is as cheap as another)
NUMERIC = [(m, name) for m, params in sorted(METHOD_PARAMS.items())
           for name, p in sorted(params.items()) if p.kind in ("int", "float") and name != "seed"]  # fmt: skip


def job(method: str, params: dict[str, object], **queries: object) -> CompactJob:
    q = QueryConfig(sources=("random",), **queries)  # type: ignore[arg-type]
    spec = CompactionSpec(method=method, ratio=0.1, method_params=params, queries=q)
    return CompactJob("fp", tuple(range(2, 2 + T)), spec)


def test_every_method_has_an_allow_list_of_its_own_parameters() -> None:
    assert set(METHOD_PARAMS) == set(METHODS)
    for name, params in METHOD_PARAMS.items():
        fields = {f.name for f in dataclasses.fields(method_class(name)) if f.init}
        assert set(params) <= fields, (name, set(params) - fields)
    # a path on the server is never a request's to choose
    assert "calibration" not in METHOD_PARAMS["compresskv"]


@pytest.mark.parametrize(("method", "param"), NUMERIC)
def test_every_numeric_parameter_at_a_billion_is_refused(method: str, param: str) -> None:
    with pytest.raises(InvalidRequest, match=rf"^method_params\.{param} = 1000000000 is outside"):
        job(method, {param: 10**9}).validate(4096)


@pytest.mark.parametrize(
    ("method", "params", "field"),
    [
        ("am-omp", {"nnls_iters": 1e9}, "method_params.nnls_iters must be an integer"),
        ("am-omp-fast", {"k": 2.0}, "method_params.k must be an integer"),
        ("gvote", {"S": 10**8}, r"method_params.S = 100000000 is outside \[1, queries = 16384\]"),
        ("gvote", {"horizon": 10**9}, r"method_params.horizon = 1000000000 is outside \[1, prefix"),
        ("snapkv", {"kernel": 10**7 + 1}, r"method_params.kernel = 10000001 is outside \[1, prefix"),
        ("h2o", {"window": 10**9}, r"method_params.window = 1000000000 is outside \[0, prefix"),
        ("snapkv", {"kernel": T + 1}, rf"method_params.kernel = {T + 1} is outside \[1, prefix = {T}\]"),
        ("keep-only", {"inner_params": {"nnls_iters": 1e9}},
         "method_params.inner_params.nnls_iters must be an integer"),
        ("keep-only", {"inner": "am-omp", "inner_params": {"nnls_iters": 10**9}},
         r"method_params.inner_params.nnls_iters = 1000000000 is outside"),
        ("keep-only", {"inner": "keep-only"}, "method_params.inner must be a method name"),
        ("compresskv", {"calibration": "/etc/passwd"},
         "method_params.calibration is not a parameter a request may set"),
        ("am-highest", {"no_such": 1}, "method_params.no_such is not a parameter"),
        ("am-highest", {"beta_bounds": [-1e9, 3.0]}, r"method_params.beta_bounds = .* is outside"),
        ("am-highest", {"fit_values": 1}, "method_params.fit_values must be true or false"),
        ("kvcompose", {"agg_task": "x" * 10**6}, "method_params.agg_task must be a string"),
    ],
)  # fmt: skip
def test_types_nesting_and_unsettable_parameters_are_refused(
    method: str, params: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequest, match=rf"^{field}"):
        job(method, params).validate(4096)


def test_megabytes_of_self_study_prompts_are_refused() -> None:
    prompts = ("x" * (1 << 20),) * 15  # 15 MB: fits a 16 MB message
    with pytest.raises(InvalidRequest, match=r"^queries.self_study_prompts = 1048576 is over"):
        job("am-highest", {}, self_study_prompts=prompts).validate(4096)


def test_ordinary_parameters_pass_and_bounds_follow_the_prefix() -> None:
    job("am-omp-fast", {"k": 4, "tau": 2, "nnls_iters": 4, "value_ridge": 1e-3}).validate(4096)
    job("keep-only", {"inner": "am-highest", "inner_params": {"beta_bounds": [-3, 3]}}).validate(
        4096
    )
    job("gvote", {"S": 8, "horizon": 32, "p": 0.9, "refit": "am"}).validate(4096)
    caps = Caps(prefix=1000, queries=16, iterations=8)
    check_method_params("snapkv", {"kernel": 1000}, caps)  # at the bound
    with pytest.raises(ValueError, match="kernel = 1001 is outside"):
        check_method_params("snapkv", {"kernel": 1001}, caps)


def test_a_deeply_nested_spec_is_a_clear_refusal_not_a_recursion_error() -> None:
    """json.loads of 10^5 nested arrays raises RecursionError: the service once answered it
    INTERNAL, with a traceback in its log for each such request."""
    from compactor.service.convert import job_from_request
    from compactor.service.gen.compactor.v1 import compactor_pb2 as pb

    req = pb.CompactRequest(token_ids=[1, 2, 3], spec_json="[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidRequest, match="nests too deeply"):
        job_from_request(req, 0.1)


def test_one_caller_cannot_fill_the_queue_by_default() -> None:
    """Without mTLS every caller is the one tenant "": the per-tenant default must leave room
    in the pool's queue for others, and `compactor serve` takes both defaults from one place."""
    import argparse

    from compactor.commands.serve import add_arguments
    from compactor.service.engine import ServiceConfig
    from compactor.workers.pool import PoolConfig

    pool = PoolConfig(model_dir="m")
    per_tenant = ServiceConfig(pool=pool).max_per_tenant
    assert per_tenant * 2 <= pool.max_queue
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert (args.max_requests_per_tenant, args.max_queue) == (per_tenant, pool.max_queue)
