"""gRPC health check for the compaction service (exit 0 = SERVING), used by container probes.

Kubernetes' built-in `grpc` probe cannot speak TLS, so the probes exec this instead. The health
service needs no auth token. Usage: python healthcheck.py [--address H:P] [--tls-ca CA]
[--tls-server-name NAME] [--timeout S]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT of the service")
    p.add_argument("--tls-ca", type=Path, help="CA bundle: use TLS and verify the server")
    p.add_argument("--tls-server-name", help="name the server certificate is issued for")
    p.add_argument("--service", default="", help="health service name ('' = whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    return p


def check(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = []
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=args.tls_ca.read_bytes())
        channel = grpc.secure_channel(args.address, creds, options=options)
    else:
        channel = grpc.insecure_channel(args.address, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(check(build_parser().parse_args()))
