"""Block until the Ray cluster has at least --gpus GPUs (exit 1 after --timeout seconds).

Run before `compactor serve --ray-address auto` on the head: the pool asks for a GPU per actor
only if the cluster already shows GPUs when it starts, so starting it before the GPU workers
have joined would put CPU-only actors on them.
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="auto", help="Ray address (default: the local cluster)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs to wait for")
    p.add_argument("--timeout", type=float, default=900.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import ray

    deadline = time.monotonic() + args.timeout
    while True:  # the local `ray start` may still be coming up
        try:
            ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                print(f"timeout: no Ray cluster at {args.address!r}", flush=True)
                return 1
            time.sleep(2)
    try:
        while True:
            have = int(ray.cluster_resources().get("GPU", 0))
            if have >= args.gpus:
                print(f"ray cluster has {have} GPUs", flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"timeout: {have}/{args.gpus} GPUs after {args.timeout:.0f} s", flush=True)
                return 1
            time.sleep(5)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
