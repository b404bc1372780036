"""Requests: the one place where the request's protobuf message and domain types meet.

Wire format of a request: the CompactionSpec as one JSON object (``spec_json``, see
:meth:`CompactionSpec.to_dict`) next to the model fingerprint, the prefix, its follow-ups
and the keys/values dtype asked for (``kv_dtype``, "" = float32). A result travels as
`compactor.service.result_stream` says.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.spec import CompactionSpec
from compactor.types import dtype_from_name, dtype_name
from compactor.workers.errors import InvalidRequest
from compactor.workers.job import CompactJob

__all__ = ["compact_request", "job_from_request", "kv_dtype_field", "request_from_job"]


def kv_dtype_field(kv_dtype: torch.dtype | str | None) -> str:
    """The request's ``kv_dtype`` string ("" for None / float32); ValueError if unsupported."""
    if kv_dtype is None:
        return ""
    name = kv_dtype if isinstance(kv_dtype, str) else dtype_name(kv_dtype)
    dtype_from_name(name)  # ValueError naming the supported dtypes
    return "" if name == "float32" else name


# ---- requests --------------------------------------------------------------------------
def job_from_request(req: pb.CompactRequest, auto_ratio: float) -> CompactJob:
    """Decode a CompactRequest (budget 'auto' -> `auto_ratio`); InvalidRequest if malformed.

    The spec's values are checked by :meth:`CompactJob.validate` (the service's policy).
    """
    if not req.spec_json:
        raise InvalidRequest("spec_json is required (a CompactionSpec as a JSON object)")
    try:
        spec = CompactionSpec.from_dict(json.loads(req.spec_json))
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"spec_json is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(
            "spec_json nests too deeply (a CompactionSpec is a flat object)"
        ) from None
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"spec_json: {exc}") from None
    try:
        kv_dtype = kv_dtype_field(req.kv_dtype or None)
    except ValueError as exc:
        raise InvalidRequest(f"kv_dtype: {exc}") from None
    return CompactJob(
        model_fingerprint=req.model_fingerprint,
        token_ids=tuple(req.token_ids),
        spec=spec.resolve_auto(auto_ratio),
        follow_ups=tuple(tuple(f.token_ids) for f in req.follow_ups),
        request_id=req.request_id,
        kv_dtype=kv_dtype,
        fit_round=int(req.fit_round),
    )


def compact_request(
    token_ids: Sequence[int],
    model_fingerprint: str,
    spec: CompactionSpec,
    follow_ups: Sequence[Sequence[int]] = (),
    request_id: str = "",
    kv_dtype: torch.dtype | str | None = None,
    fit_round: int = 0,
) -> pb.CompactRequest:
    """The CompactRequest for a spec (its ratio and tokens both None = budget 'auto');
    `kv_dtype` asks for keys/values in that dtype (None = float32); `fit_round`: 0 for a
    first fit, n for the n-th refit. ValueError if the dtype is not float32, float16 or
    bfloat16, or `fit_round` is negative."""
    if fit_round < 0:
        raise ValueError(f"fit_round must be >= 0, got {fit_round}")
    return pb.CompactRequest(
        model_fingerprint=model_fingerprint,
        token_ids=[int(t) for t in token_ids],
        spec_json=json.dumps(spec.to_dict(), sort_keys=True),
        follow_ups=[pb.TokenSequence(token_ids=[int(t) for t in f]) for f in follow_ups],
        request_id=request_id,
        kv_dtype=kv_dtype_field(kv_dtype),
        fit_round=fit_round,
    )


def request_from_job(job: CompactJob) -> pb.CompactRequest:
    """Inverse of :func:`job_from_request`."""
    return compact_request(
        job.token_ids,
        job.model_fingerprint,
        job.spec,
        job.follow_ups,
        job.request_id,
        job.kv_dtype or None,
        job.fit_round,
    )
