"""Command line of the load generator: ``kvmaster-loadgen`` / ``python -m kvmaster.tools.loadgen``.

Subcommands:

* ``replay TRACE.jsonl``: replay a Mooncake-format trace against a master;
* ``synthetic``: replay a seeded synthetic multi-turn chat trace;
* ``reference TRACE.jsonl``: exact LRU, Belady and unbounded prefix hit rates, no master.

Flag defaults come from :class:`~kvmaster.tools.loadgen.replay.LoadgenConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence

from .reference import belady_prefix_hit_rate, lru_prefix_hit_rate, unbounded_prefix_hit_rate
from .replay import LoadgenConfig, LoadgenError, format_summary, run_replay
from .synthetic import synthetic_trace
from .traces import read_mooncake

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "config_from_args", "main"]


def _add_run_flags(p: argparse.ArgumentParser, d: LoadgenConfig) -> None:
    p.add_argument("--master", default=d.master, metavar="HOST:PORT",
                   help="address of a running master (default: start an embedded one)")
    p.add_argument("--workers", type=int, default=d.workers,
                   help="client worker processes (default: %(default)s)")
    p.add_argument("--block-bytes", type=int, default=d.block_bytes,
                   help="bytes per KV block (default: %(default)s)")
    p.add_argument("--capacity-blocks", type=int, default=d.capacity_blocks,
                   help="total segment capacity over all workers, in blocks; each worker "
                        "mounts ceil(capacity/workers) blocks (default: %(default)s)")
    p.add_argument("--speed", type=float, default=d.speed,
                   help="time scaling of trace timestamps, 2 = twice as fast; "
                        "0 = as fast as possible (default: %(default)s)")
    p.add_argument("--limit", type=int, default=d.limit,
                   help="replay only the first N requests")
    p.add_argument("--json", dest="json_path", default=d.json_path, metavar="PATH",
                   help="write the result as JSON to PATH")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=d.progress,
                   help="no progress bar (it is also off when stderr is not a terminal)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="random seed: generates the synthetic trace; recorded in the "
                        "JSON (default: %(default)s)")
    p.add_argument("--namespace", default=d.namespace,
                   help="block key prefix (default: a fresh random one per run)")
    p.add_argument("--tenant", default=d.tenant, help="tenant name (default: %(default)s)")
    p.add_argument("--queue-depth", type=int, default=d.queue_depth,
                   help="requests queued per worker before dispatch blocks "
                        "(default: %(default)s)")
    p.add_argument("--client-factory", default=d.client_factory, metavar="MODULE:CALLABLE",
                   help="callable returning a client to set up (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of all subcommands."""
    d = LoadgenConfig()
    parser = argparse.ArgumentParser(
        prog="kvmaster-loadgen",
        description="Trace-driven load generator and cache references for kvmaster.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    rp = sub.add_parser("replay", help="replay a Mooncake-format trace against a master")
    rp.add_argument("trace", metavar="TRACE.jsonl", help="Mooncake FAST'25 JSON Lines trace")
    _add_run_flags(rp, d)

    sp = sub.add_parser("synthetic", help="replay a seeded synthetic multi-turn chat trace")
    _add_run_flags(sp, d)
    sp.add_argument("--requests", type=int, default=d.requests,
                    help="requests to generate (default: %(default)s)")

    ref = sub.add_parser("reference", help="exact LRU / Belady / unbounded hit rates, no master")
    ref.add_argument("trace", metavar="TRACE.jsonl", help="Mooncake FAST'25 JSON Lines trace")
    ref.add_argument("--capacity-blocks", type=int, default=d.capacity_blocks,
                     help="cache capacity in blocks (default: %(default)s)")
    ref.add_argument("--limit", type=int, default=d.limit, help="first N requests only")
    ref.add_argument("--json", dest="json_path", default=d.json_path, metavar="PATH",
                     help="write the figures as JSON to PATH")
    return parser


def config_from_args(args: argparse.Namespace) -> LoadgenConfig:
    """LoadgenConfig from parsed arguments (fields absent from ``args`` keep their default)."""
    kwargs = {f.name: getattr(args, f.name)
              for f in dataclasses.fields(LoadgenConfig) if hasattr(args, f.name)}
    return LoadgenConfig(**kwargs)


def _run_reference(config: LoadgenConfig) -> int:
    assert config.trace is not None
    requests = read_mooncake(config.trace, config.limit)
    cap = config.capacity_blocks
    results = [lru_prefix_hit_rate(requests, cap), belady_prefix_hit_rate(requests, cap),
               unbounded_prefix_hit_rate(requests)]
    distinct = len({h for r in requests for h in r.hash_ids})
    print(f"trace {config.trace}: {len(requests):,} requests, {results[0].blocks:,} block "
          f"references, {distinct:,} distinct blocks; capacity {cap:,} blocks")
    print(f"{'policy':<10}{'prefix hit rate':>17}{'block hit rate':>16}{'evictions':>12}")
    for r in results:
        print(f"{r.policy:<10}{r.hit_rate:>17.4%}{r.block_hit_rate:>16.4%}{r.evictions:>12,}")
    if config.json_path:
        doc = {"trace": config.trace, "limit": config.limit, "capacity_blocks": cap,
               "requests": len(requests), "distinct_blocks": distinct,
               "results": {r.policy: r.to_dict() for r in results}}
        with open(config.json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        config.validate()
        if args.command == "reference":
            return _run_reference(config)
        if args.command == "replay":
            assert config.trace is not None
            requests = read_mooncake(config.trace, config.limit)
        else:
            requests = synthetic_trace(config.requests, config.seed)
            if config.limit is not None:
                requests = requests[:config.limit]
        result = run_replay(config, requests)
    except (LoadgenError, ValueError, OSError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    print(format_summary(result))
    return 0
