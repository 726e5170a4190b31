"""``kvmaster`` command line: ``kvmaster master [flags]``."""

from __future__ import annotations

import argparse
import logging
import sys

from kvmaster.config import MasterConfig, add_cli_args, from_cli_args


def _master(args: argparse.Namespace) -> int:
    try:
        config = from_cli_args(MasterConfig, args)
    except ValueError as exc:
        print(f"kvmaster master: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from kvmaster.master import run_master

    def started(endpoint: str, metrics: str = "") -> None:
        print(f"kvmaster master listening on {endpoint}", flush=True)
        if metrics:
            print(f"kvmaster metrics on {metrics}", flush=True)

    run_master(config, started)
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from kvmaster import auth

    try:
        written = auth.keygen(args.dir, args.client, args.tenant)
    except (ValueError, FileExistsError) as exc:
        print(f"kvmaster keygen: {exc}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmaster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("master", help="run the master (ROUTER socket + shard actors)")
    add_cli_args(MasterConfig, p)
    p.set_defaults(func=_master)
    k = sub.add_parser("keygen", help="make CURVE keys: the master's pair, and a client's pair "
                                      "bound to a tenant")
    k.add_argument("dir", help="key directory (created if missing)")
    k.add_argument("--client", help="client name: writes clients/NAME.key{,_secret}")
    k.add_argument("--tenant", default="default", help="tenant the client's key is bound to")
    k.set_defaults(func=_keygen)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
