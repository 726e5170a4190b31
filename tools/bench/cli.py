"""kvmaster's benchmarks: ``store``, ``profile``, ``actor``, ``attack``, ``blocks``, ``xhost``
and ``all`` (see also ``python -m kvmaster.tools.bench.layers``).
``python -m kvmaster.tools.bench COMMAND``.

``store``: store operations, kvmaster vs the Mooncake Store master, in one run
(:mod:`kvmaster.tools.bench.store_bench`).  ``profile`` runs kvmaster's master under a
profiler while a client drives single-op or 1024-key batch load (is_exist,
batch_is_exist, get_batch, put_batch).  ``actor`` calls one shard actor directly (no
sockets, no client) and prints µs per key of 1024-key batch put start, put end, get,
exist (hits, misses) and remove: the master's own work, for A/Bs.  ``all`` runs the
store, scale and session benchmarks with one summary of ratios (the scale and session
benchmarks run alone as ``python -m kvmaster.tools.bench.scale_bench`` and
``...session_bench``).  ``attack`` measures a well-behaved client's latency while another
tenant attacks the master (:mod:`kvmaster.tools.bench.attack_bench`).  ``blocks``: put
and get of MiB-sized blocks on one host against a single-thread memcpy of the same bytes
(:mod:`kvmaster.tools.bench.blocks_bench`).  ``xhost``: 1 and 16 MiB blocks between two
network-namespace hosts through the transfer service against a plain TCP stream
(:mod:`kvmaster.tools.bench.xhost_bench`).  ``oplog``: the HA op log's cost and failover time
(:mod:`kvmaster.tools.bench.oplog_bench`).
"""

from __future__ import annotations

import argparse

from . import _actor, _profile, all_bench, attack_bench, blocks_bench, oplog_bench, xhost_bench
from .store_bench import cmd_store


def cmd_profile(a: argparse.Namespace) -> int:
    return _profile.run(a)


def cmd_actor(a: argparse.Namespace) -> int:
    return _actor.run(a)


def main(argv: list[str] | None = None) -> int:
    try:
        from kvmaster.cli import plain_doc
    except ImportError:  # an older kvmaster on PYTHONPATH (an A/B): the doc as it is
        def plain_doc(doc: str | None) -> str:
            return doc or ""

    p = argparse.ArgumentParser(prog="python -m kvmaster.tools.bench",
                                description=plain_doc(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("store", help="kvmaster vs Mooncake master, same scenarios, same run")
    s.add_argument("--quick", action="store_true", help="smaller counts (1000 ops, 4096 keys)")
    s.add_argument("--runs", type=int, default=3, help="runs per cell; the median is reported")
    s.add_argument("--pin", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="pin master and client to CPU 0 (`--pin both`: a table for each)")
    s.add_argument("--json", default="", help="write all results (per run too) here")
    s.add_argument("--md", default="", help="write the markdown tables here")
    s.add_argument("--groups", default="single,batch,memory,echo",
                   help="comma list of single,batch,memory,echo,compat (compat: Mooncake's "
                        "API through kvmaster.compat against mooncake.store: 1,024-key "
                        "batch_is_exist, 64 x 2 MiB multi-buffer put and get)")
    s.add_argument("--n", type=int, default=0, help="calls per single-op phase")
    s.add_argument("--batch-keys", type=int, default=0, help="keys per batch phase")
    s.add_argument("--batch-sizes", default="64,1024")
    s.add_argument("--mem-objects", type=int, default=0)
    s.add_argument("--deadline", type=float, default=30.0, help="wall cap per timed phase, s")
    s.add_argument("--worker-timeout", type=float, default=600.0, help="cap per worker process, s")
    s.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each group of each run, wait up to SECONDS for other work "
                        "to stop")
    s.add_argument("--wait-total", type=float, default=3600.0, metavar="SECONDS",
                   help="cap on all --wait-quiet waiting of the command")
    s.add_argument("--quiet-busy", type=float, default=0.10,
                   help="busy fraction of the machine below which it counts as quiet")
    s.add_argument("--keep", action="store_true", help="keep the work directory (logs, raw JSON)")
    s.add_argument("--integrity", action="store_true",
                   help="batch group: also kvmaster with checksums off, and both with the "
                        "objects in a peer's segment (an extra table)")
    s.add_argument("--no-anchor", action="store_true",
                   help="kvmaster only (no Mooncake runs or comparison tables)")
    s.add_argument("--kvmaster-args", default="", metavar="FLAGS",
                   help="extra flags for every kvmaster master, e.g. \"--shards 1\" "
                        "(default: none, the master's defaults)")
    s.set_defaults(func=cmd_store)
    pr = sub.add_parser("profile", help="profile kvmaster's master under single-op and "
                                        "1024-key batch load",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pr.add_argument("--seconds", type=float, default=8.0, help="load duration per workload")
    pr.add_argument("--profiler", choices=["cprofile", "py-spy", "both", "none"], default="both",
                    help="cprofile needs nothing extra; py-spy must be installed; none: only "
                         "rates and master CPU")
    pr.add_argument("--py-spy", default="py-spy", help="py-spy executable")
    pr.add_argument("--pin", action="store_true", help="master and client on CPU 0")
    pr.add_argument("--top", type=int, default=20, help="functions listed per profile")
    pr.add_argument("--client", action="store_true",
                    help="with cprofile: also profile the client side of the load loop")
    pr.add_argument("--out-dir", default="", help="keep .prof / raw stacks here")
    pr.add_argument("--workloads", default="is_exist,batch_is_exist_1024",
                    help="comma list of is_exist, batch_is_exist_1024, get_batch_1024, "
                         "put_batch_1024 (put_batch then batch_remove of fresh keys), "
                         "put_batch_evicting_1024 (fresh 4 KiB keys into a full segment)")
    pr.set_defaults(func=cmd_profile)
    ac = sub.add_parser("actor", help="one shard actor called directly: µs per key of "
                                      "1024-key batch put start, put end, get, exist "
                                      "(hits, misses) and remove (min / median; no "
                                      "sockets)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ac.add_argument("--rounds", type=int, default=200, help="rounds of the six batch ops")
    ac.add_argument("--keys", type=int, default=1024, help="keys per batch")
    ac.add_argument("--value-bytes", type=int, default=4096, help="size of each value")
    ac.add_argument("--eviction-policy", default="", metavar="P[,P...]",
                    help="the master's --eviction-policy (default: its default); several, "
                         "comma-separated, are measured in turn, alternating by round block")
    ac.add_argument("--variant", action="append", default=None, metavar="FIELD=V[,...]",
                    help="master config fields of one variant (e.g. 'tenant_quota_bytes="
                         "1099511627776'; '' = defaults); given several times, the variants "
                         "are measured in turn, alternating by round block")
    ac.add_argument("--tenant", default="default",
                    help="the bench client's tenant (quotas do not apply to the admin one)")
    ac.add_argument("--checksums", default="off", metavar="off|on|off,on",
                    help="end the writes with checksums and read with with_checksum "
                         "(protocol 1.4); off,on measures both, alternating by round block")
    ac.set_defaults(func=cmd_actor)
    al = sub.add_parser("all", help="store, scale and session benchmarks in sequence; one "
                                     "summary of ratios against the anchors",
                        description=all_bench.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    all_bench.add_arguments(al)
    al.set_defaults(func=all_bench.cmd_all)
    at = sub.add_parser("attack", help="a well-behaved client's latency while another "
                                       "tenant attacks the master, against quiet phases",
                        description=attack_bench.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    attack_bench.add_arguments(at)
    at.set_defaults(func=attack_bench.cmd_attack)
    bl = sub.add_parser("blocks", help="put and get of MiB-sized blocks on one host against "
                                       "a single-thread memcpy of the same bytes",
                        description=blocks_bench.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    blocks_bench.add_arguments(bl)
    bl.set_defaults(func=blocks_bench.cmd_blocks)
    xh = sub.add_parser("xhost", help="blocks between two network-namespace hosts through "
                                      "the transfer service against a plain TCP stream",
                        description=xhost_bench.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    xhost_bench.add_arguments(xh)
    xh.set_defaults(func=xhost_bench.cmd_xhost)
    ol = sub.add_parser("oplog", help="the HA op log: put cost (A/B), etcd bytes and standby "
                                      "memory per object, failover time at 100k and 1M objects",
                        description=oplog_bench.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    oplog_bench.add_arguments(ol)
    ol.set_defaults(func=oplog_bench.cmd_oplog)
    a = p.parse_args(argv)
    return int(a.func(a))


if __name__ == "__main__":
    raise SystemExit(main())
