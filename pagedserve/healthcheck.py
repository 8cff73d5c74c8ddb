"""python -m pagedserve.healthcheck HOST:PORT: exits 0 when the service there answers the gRPC health check
with SERVING, 1 otherwise; what compose's health checks run (Kubernetes probes gRPC health natively).
Health needs no credentials; with TLS, give the CA (and for mutual TLS a certificate) as the services take
them."""
from __future__ import annotations

import argparse
import sys

from pagedserve.config import ServingConfig, add_arguments, from_args
from pagedserve.service import Security, wait_until_serving

SECTIONS = {ServingConfig: ("tls_cert", "tls_key", "tls_ca")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.healthcheck", description=__doc__)
    parser.add_argument("address", help="host:port of the service")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default: 5)")
    add_arguments(parser, SECTIONS)
    args = parser.parse_args(argv)
    serving = from_args(parser, args, SECTIONS)[ServingConfig]
    try:
        wait_until_serving(args.address, args.timeout, Security.from_config(serving, {}))
    except Exception as error:
        print(f"{args.address}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
