"""The gRPC compaction service (grpc.aio): proto <-> domain conversion, the engine
(fingerprint check, result cache, single-flight, worker pool), a thin servicer, auth,
metrics and the server. Generated protobuf code lives in ``compactor.service.gen``.
"""
