"""Command line of the load generator: ``kvmaster-loadgen`` / ``python -m kvmaster.tools.loadgen``.

Subcommands:

* ``replay TRACE...``: replay a Mooncake ``.jsonl`` trace or kv-cache-tester
  ``.json`` files (or a directory of them) against a master;
* ``synthetic``: replay a seeded synthetic multi-turn chat trace;
* ``reference TRACE...``: exact LRU, Belady, unbounded and retention-policy
  model hit rates, no master;
* ``compare TRACE...``: replay several retention policies and capacities on
  the same trace; write a table, the JSON results and PNG plots.

Flag defaults come from :class:`~kvmaster.tools.loadgen.replay.LoadgenConfig`
(and :class:`~kvmaster.tools.loadgen.compare.CompareConfig`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence

from kvmaster.errors import KVMasterError

from .reference import (
    ORDER_POLICIES,
    belady_prefix_hit_rate,
    lru_prefix_hit_rate,
    order_prefix_hit_rate,
    policy_prefix_hit_rate,
    unbounded_prefix_hit_rate,
)
from .replay import (
    ROUTINGS,
    LoadgenConfig,
    LoadgenError,
    format_summary,
    load_config_trace,
    run_replay,
)
from .sessions import RETENTIONS
from .synthetic import synthetic_trace
from .traces import TRACE_FORMATS

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "config_from_args", "main"]


def _add_trace_flags(p: argparse.ArgumentParser, d: LoadgenConfig) -> None:
    p.add_argument("trace", nargs="+", metavar="TRACE",
                   help="a Mooncake FAST'25 .jsonl trace, or kv-cache-tester .json files "
                        "or a directory of them")
    p.add_argument("--trace-format", choices=TRACE_FORMATS, default=d.trace_format,
                   help="trace format (default: %(default)s, by file extension)")
    p.add_argument("--stagger-s", type=float, default=d.stagger_s,
                   help="kv-cache-tester: trace seconds between the starts of consecutive "
                        "conversations (default: %(default)s)")
    p.add_argument("--arrival-rate", type=float, default=d.arrival_rate, metavar="R",
                   help="kv-cache-tester: conversations start as a Poisson process of R per "
                        "trace second (seeded by --seed) instead of --stagger-s apart; each "
                        "keeps its own think times, and --speed scales both")
    p.add_argument("--limit", type=int, default=d.limit,
                   help="only the first N requests (of the merged trace)")


def _add_session_flags(p: argparse.ArgumentParser, d: LoadgenConfig) -> None:
    p.add_argument("--retention", choices=RETENTIONS, default=d.retention,
                   help="what keeps blocks under pressure: none (LRU), session-pin (pin live "
                        "sessions, unpin when idle), ttl-pin (native soft-pin TTL on writes), "
                        "lifecycle (pin after a tool call and while a sub-agent runs, unpin "
                        "--end-turn-grace-s after the end of a turn), session-oracle "
                        "(clairvoyant pins, for diagnosis) (default: %(default)s)")
    p.add_argument("--sessions", action=argparse.BooleanOptionalAction, default=d.sessions,
                   help="run the session calls: tag writes, attach, update, pin, close "
                        "(default: on)")
    p.add_argument("--idle-s", type=float, default=d.idle_s,
                   help="trace seconds without a request after which a session is unpinned "
                        "(ttl-pin: the TTL) (default: %(default)s)")
    p.add_argument("--end-idle-s", type=float, default=d.end_idle_s,
                   help="trace seconds without a request after which a conversation has "
                        "ended and its session is closed (default: %(default)s)")
    p.add_argument("--pin-min-turns", type=int, default=d.pin_min_turns,
                   help="session-pin: pin a session from its N-th request on "
                        "(default: %(default)s)")
    p.add_argument("--end-turn-grace-s", type=float, default=d.end_turn_grace_s,
                   help="lifecycle: trace seconds a session stays pinned after a reply that "
                        "ended the turn (after a tool call: --idle-s) (default: %(default)s)")


def _add_run_flags(p: argparse.ArgumentParser, d: LoadgenConfig) -> None:
    p.add_argument("--master", default=d.master, metavar="HOST:PORT",
                   help="address of a running master (default: start an embedded one)")
    p.add_argument("--master-shards", type=int, default=d.master_shards,
                   help="embedded master: shard count (default: 0, the master's own default)")
    p.add_argument("--master-watermark", type=float, default=d.master_watermark,
                   help="embedded master: --eviction-high-watermark-ratio (default: the "
                        "master's, 0.9; 1.0 evicts only when an allocation fails); with "
                        "--master, the running master's setting; the references use the "
                        "capacity it leaves")
    p.add_argument("--master-lease-ms", type=int, default=d.master_lease_ms,
                   help="embedded master: --default-kv-lease-ttl, the read lease in wall ms "
                        "(default: the master's, 10000); leased blocks cannot be evicted, so "
                        "a fast replay wants it short")
    p.add_argument("--master-args", default=d.master_args, metavar="FLAGS",
                   help="embedded master: more flags, one string (e.g. "
                        "\"--eviction-ratio 0.02\")")
    p.add_argument("--master-pid", type=int, default=d.master_pid,
                   help="pid of a running master, for its RSS and CPU (default: the owner "
                        "of its port when it runs on this host)")
    p.add_argument("--workers", type=int, default=d.workers,
                   help="client worker processes (default: %(default)s)")
    p.add_argument("--routing", choices=ROUTINGS, default=d.routing,
                   help="which worker serves a request: by session (affinity), "
                        "round-robin or random (default: %(default)s)")
    p.add_argument("--block-bytes", type=int, default=d.block_bytes,
                   help="bytes per KV block (default: %(default)s)")
    p.add_argument("--capacity-blocks", type=int, default=d.capacity_blocks,
                   help="total segment capacity over all workers, in blocks; each worker "
                        "mounts ceil(capacity/workers) blocks (default: %(default)s)")
    p.add_argument("--speed", type=float, default=d.speed,
                   help="time scaling of trace timestamps, 2 = twice as fast; "
                        "0 = as fast as possible (default: %(default)s)")
    p.add_argument("--json", dest="json_path", default=d.json_path, metavar="PATH",
                   help="write the result as JSON to PATH")
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s,
                   help="prefill throughput the TTFT saved by prefix hits is reported at "
                        "(default: %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=d.progress,
                   help="no progress bar (it is also off when stderr is not a terminal)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="random seed: synthetic trace, random routing; recorded in the "
                        "JSON (default: %(default)s)")
    p.add_argument("--namespace", default=d.namespace,
                   help="block key prefix (default: a fresh random one per run)")
    p.add_argument("--tenant", default=d.tenant, help="tenant name (default: %(default)s)")
    p.add_argument("--queue-depth", type=int, default=d.queue_depth,
                   help="tasks in flight per worker (default: %(default)s)")
    p.add_argument("--reorder", action="store_true", default=d.reorder,
                   help="let requests of other sessions overtake one that waits for its "
                        "session's previous turn (faster at --speed 0, less faithful "
                        "interleaving)")
    p.add_argument("--client-factory", default=d.client_factory, metavar="MODULE:CALLABLE",
                   help="callable returning a client to set up (default: %(default)s)")
    p.add_argument("--audit-sessions", action="store_true", default=d.audit_sessions,
                   help="check every pin, unpin and close with get_kv_session")
    p.add_argument("--references", action=argparse.BooleanOptionalAction,
                   default=d.references,
                   help="also compute the Belady bound and the policy model (default: on)")
    p.add_argument("--sample-interval-s", type=float, default=d.sample_interval_s,
                   help="wall seconds between samples of the master's counters "
                        "(default: %(default)s)")
    p.add_argument("--profile-dir", default=d.profile_dir, metavar="DIR",
                   help="run the dispatcher and workers under cProfile; write DIR/*.prof "
                        "and DIR/*.txt")
    _add_session_flags(p, d)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of all subcommands."""
    from .compare import add_compare_flags

    d = LoadgenConfig()
    parser = argparse.ArgumentParser(
        prog="kvmaster-loadgen",
        description="Trace-driven, session-aware load generator and cache references for "
                    "kvmaster.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    rp = sub.add_parser("replay", help="replay a Mooncake or kv-cache-tester trace")
    _add_trace_flags(rp, d)
    _add_run_flags(rp, d)

    sp = sub.add_parser("synthetic", help="replay a seeded synthetic multi-turn chat trace")
    _add_run_flags(sp, d)
    sp.add_argument("--limit", type=int, default=d.limit, help="replay only the first N requests")
    sp.add_argument("--requests", type=int, default=d.requests,
                    help="requests to generate (default: %(default)s)")

    ref = sub.add_parser("reference", help="exact LRU / Belady / unbounded / policy-model "
                                           "hit rates, no master")
    _add_trace_flags(ref, d)
    ref.add_argument("--capacity-blocks", type=int, default=d.capacity_blocks,
                     help="cache capacity in blocks (default: %(default)s)")
    ref.add_argument("--seed", type=int, default=d.seed,
                     help="random seed of --arrival-rate (default: %(default)s)")
    ref.add_argument("--json", dest="json_path", default=d.json_path, metavar="PATH",
                     help="write the figures as JSON to PATH")
    ref.add_argument("--orders", default="", metavar="NAME[,NAME...]",
                     help="also simulate these eviction orders (lookup, read, write per "
                          f"request; 'all' = every one): {', '.join(ORDER_POLICIES)}")
    _add_session_flags(ref, d)

    cp = sub.add_parser("compare", help="replay several policies and capacities on one "
                                        "trace; table, JSON and PNG plots")
    _add_trace_flags(cp, d)
    _add_run_flags(cp, d)
    add_compare_flags(cp)
    return parser


def config_from_args(args: argparse.Namespace) -> LoadgenConfig:
    """LoadgenConfig from parsed arguments (fields absent from ``args`` keep their default).

    Several trace paths are joined with ``os.pathsep`` into ``trace``.
    """
    kwargs = {f.name: getattr(args, f.name)
              for f in dataclasses.fields(LoadgenConfig) if hasattr(args, f.name)}
    if isinstance(kwargs.get("trace"), list):
        kwargs["trace"] = os.pathsep.join(kwargs["trace"])
    return LoadgenConfig(**kwargs)


def _orders(spec: str) -> list[str]:
    names = list(ORDER_POLICIES) if spec == "all" else [n for n in spec.split(",") if n]
    bad = [n for n in names if n not in ORDER_POLICIES]
    if bad:
        raise ValueError(f"unknown eviction order(s) {', '.join(bad)}; "
                         f"known: {', '.join(ORDER_POLICIES)}")
    return names


def _run_reference(config: LoadgenConfig, orders: Sequence[str] = ()) -> int:
    assert config.trace is not None
    requests = load_config_trace(config)
    cap = config.capacity_blocks
    results = [lru_prefix_hit_rate(requests, cap), belady_prefix_hit_rate(requests, cap),
               unbounded_prefix_hit_rate(requests)]
    policy = config.session_policy()
    if policy.retention != "none":
        results.append(policy_prefix_hit_rate(requests, cap, policy))
    results.extend(order_prefix_hit_rate(requests, cap, name) for name in orders)
    distinct = len({h for r in requests for h in r.hash_ids})
    print(f"trace {config.trace}: {len(requests):,} requests, {results[0].blocks:,} block "
          f"references, {distinct:,} distinct blocks; capacity {cap:,} blocks")
    print(f"{'policy':<22}{'prefix hit rate':>17}{'block hit rate':>16}{'evictions':>12}")
    for r in results:
        print(f"{r.policy:<22}{r.hit_rate:>17.4%}{r.block_hit_rate:>16.4%}{r.evictions:>12,}")
    if config.json_path:
        doc = {"trace": config.trace, "limit": config.limit, "capacity_blocks": cap,
               "requests": len(requests), "distinct_blocks": distinct,
               "policy": dataclasses.asdict(policy),
               "results": {r.policy: r.to_dict() for r in results}}
        with open(config.json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        print(f"results written to {os.path.abspath(config.json_path)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = build_parser()
    from kvmaster.cli import parse_args

    args = parse_args(parser, argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        config.validate()
        if config.master and args.command != "reference":
            # A bad address fails here in one line, not in every worker's traceback.
            from kvmaster._core import check_master_address

            check_master_address(config.master)
        if args.command == "reference":
            return _run_reference(config, _orders(args.orders))
        if args.command == "compare":
            from .compare import compare_config_from_args, run_compare

            return run_compare(config, compare_config_from_args(args))
        if args.command == "replay":
            assert config.trace is not None
            requests = load_config_trace(config)
        else:
            requests = synthetic_trace(config.requests, config.seed)
            if config.limit is not None:
                requests = requests[:config.limit]
        result = run_replay(config, requests)
    except (LoadgenError, ValueError, OSError, KVMasterError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    print(format_summary(result))
    if config.json_path:
        print(f"results written to {os.path.abspath(config.json_path)}")
    return 0
