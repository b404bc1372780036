"""gRPC health check for the compaction service (exit 0 = SERVING), used by container probes.

Kubernetes' built-in `grpc` probe cannot speak TLS, so the probes exec this instead. The health
service needs no auth token; under mTLS (`compactor serve --tls-client-ca`) the probe presents a
client certificate. Usage: python healthcheck.py [--address H:P] [--tls-ca CA]
[--tls-cert CERT --tls-key KEY] [--tls-server-name NAME] [--timeout S]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT of the service")
    p.add_argument("--tls-ca", type=Path, help="CA bundle: use TLS and verify the server")
    p.add_argument("--tls-cert", type=Path, help="client certificate (mTLS), with --tls-key")
    p.add_argument("--tls-key", type=Path, help="its private key")
    p.add_argument("--tls-server-name", help="name the server certificate is issued for")
    p.add_argument("--service", default="", help="health service name ('' = whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    return p


def check(args: argparse.Namespace) -> int:
    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_cert and not args.tls_ca):
        print("healthcheck: --tls-cert and --tls-key go together, with --tls-ca", file=sys.stderr)
        return 2
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = []
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(
            root_certificates=args.tls_ca.read_bytes(),
            private_key=args.tls_key.read_bytes() if args.tls_key else None,
            certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
        )
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
