from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CompactRequest(_message.Message):
    __slots__ = ("model_fingerprint", "token_ids", "request_id", "spec_json", "follow_ups", "kv_dtype", "fit_round")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_UPS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FIT_ROUND_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    spec_json: str
    follow_ups: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    kv_dtype: str
    fit_round: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., spec_json: _Optional[str] = ..., follow_ups: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., kv_dtype: _Optional[str] = ..., fit_round: _Optional[int] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("metadata_json", "num_layers", "num_kv_heads", "head_dim", "dtype", "tensors", "payload_bytes")
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    metadata_json: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    payload_bytes: int
    def __init__(self, metadata_json: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("sha256", "payload_bytes", "cache_hit", "shared", "server_seconds", "compute_seconds", "worker", "stage_seconds", "hmac_sha256")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HMAC_SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    payload_bytes: int
    cache_hit: bool
    shared: bool
    server_seconds: float
    compute_seconds: float
    worker: str
    stage_seconds: _containers.ScalarMap[str, float]
    hmac_sha256: str
    def __init__(self, sha256: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., shared: _Optional[bool] = ..., server_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., worker: _Optional[str] = ..., stage_seconds: _Optional[_Mapping[str, float]] = ..., hmac_sha256: _Optional[str] = ...) -> None: ...

class CompactChunk(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: Header
    chunk: TensorChunk
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_fingerprint", "name", "num_layers", "num_kv_heads", "head_dim", "dtype", "max_prefix_tokens", "auto_ratio", "workers", "limits")
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUTO_RATIO_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_prefix_tokens: int
    auto_ratio: float
    workers: int
    limits: _containers.ScalarMap[str, int]
    def __init__(self, model_fingerprint: _Optional[str] = ..., name: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., max_prefix_tokens: _Optional[int] = ..., auto_ratio: _Optional[float] = ..., workers: _Optional[int] = ..., limits: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ListMethodsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMethodsResponse(_message.Message):
    __slots__ = ("methods",)
    METHODS_FIELD_NUMBER: _ClassVar[int]
    methods: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, methods: _Optional[_Iterable[str]] = ...) -> None: ...
