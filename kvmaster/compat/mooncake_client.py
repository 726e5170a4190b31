"""kvmaster's ``mooncake_client``: ``python -m kvmaster.compat.mooncake_client
--master_server_address=HOST:PORT [--port=50052] [--global_segment_size="4 GB"] ...``
sets up a real client and serves the dummy clients of this host (see
:mod:`kvmaster.compat._dummy`; the flags are Mooncake's ``real_client_main.cpp``'s)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from kvmaster.compat._dummy import RealClientService
from kvmaster.compat._mooncake_config import parse_size
from kvmaster.compat._store import MooncakeDistributedStore


def _flags() -> argparse.ArgumentParser:
    """``mooncake_client``'s flags (real_client_main.cpp), gflags style (``--a=b``
    and ``--a b`` both work)."""
    p = argparse.ArgumentParser(prog="python -m kvmaster.compat.mooncake_client",
                                description="kvmaster's mooncake_client: a real client "
                                            "that dummy clients on this host use")
    p.add_argument("--host", default="0.0.0.0", help="local hostname (default: 0.0.0.0)")
    p.add_argument("--port", type=int, default=50052, help="service port (default: 50052)")
    p.add_argument("--metadata_server", default="http://127.0.0.1:8080/metadata")
    p.add_argument("--device_names", default="")
    p.add_argument("--master_server_address", default="127.0.0.1:50051")
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--global_segment_size", default="4 GB")
    p.add_argument("--local_buffer_size", default="0")
    p.add_argument("--threads", type=int, default=1, help="accepted; one thread per request")
    p.add_argument("--tenant_id", default="default")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Set up a real store and serve dummy clients until SIGTERM or SIGINT.  Prints
    ``real client service listening on HOST:PORT`` once it serves."""
    args = _flags().parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        gss = parse_size(args.global_segment_size, "--global_segment_size")
        lbs = parse_size(args.local_buffer_size, "--local_buffer_size")
    except ValueError as exc:
        print(f"mooncake_client: {exc}", file=sys.stderr)
        return 2
    store = MooncakeDistributedStore()
    host = args.host.rpartition(":")[0] if ":" in args.host else args.host
    rc = store.setup(args.host if args.host not in ("0.0.0.0", "") else "localhost",
                     args.metadata_server, gss, lbs, args.protocol, args.device_names,
                     args.master_server_address, tenant_id=args.tenant_id)
    if rc != 0:
        print(f"mooncake_client: failed to set up the client: {rc}", file=sys.stderr)
        return 1
    try:
        service = RealClientService(store, host, args.port)
    except OSError as exc:
        store.close()
        print(f"mooncake_client: cannot serve on {host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"real client service listening on {service.address}", flush=True)
    while not stop.wait(1.0):
        pass
    service.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
