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

    def started(endpoint: str) -> None:
        print(f"kvmaster master listening on {endpoint}", flush=True)

    run_master(config, started)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmaster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("master", help="run the master (ROUTER socket + shard actors)")
    add_cli_args(MasterConfig, p)
    p.set_defaults(func=_master)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
