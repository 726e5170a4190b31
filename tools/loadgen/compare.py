"""``kvmaster-loadgen compare``: several retention policies and capacities on one trace.

For every capacity (``--capacities``: fractions of the trace's distinct blocks,
or block counts when above 1) and every policy (``--policies``), one replay
runs with the same trace, workers and routing (a fresh embedded master each,
unless ``--master`` is given).  The tool also computes, by itself, the exact
LRU and clairvoyant Belady bounds on a finer capacity grid and the model of
each policy (see :func:`~kvmaster.tools.loadgen.reference.policy_prefix_hit_rate`),
including the clairvoyant ``session-oracle``.  The references of a run use the
capacity the master keeps (its effective capacity: the segments' blocks times
the high watermark), not the segments' size.  Each row also gives the prefill
tokens and the TTFT (at ``--prefill-tokens-per-s``) its prefix hits saved per
request, p50 and p99.

Writes into ``--out-dir``: one JSON result per run (``<policy>-<capacity>.json``),
``compare.json`` (everything the table and plots use), ``compare.md`` (the
table) and, unless ``--no-plots``, ``hit_rate_vs_capacity.png``,
``over_time.png`` (hit rate and pinned bytes over trace time at the main
capacity) and ``latency_cdf.png`` (per op, per policy, at the main capacity).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .reference import belady_prefix_hit_rate, lru_prefix_hit_rate, policy_prefix_hit_rate
from .replay import LoadgenConfig, format_summary, load_config_trace, run_replay
from .sessions import RETENTIONS
from .traces import Request

logger = logging.getLogger(__name__)

__all__ = ["CompareConfig", "add_compare_flags", "compare_config_from_args", "compare_table",
           "run_compare"]

#: Capacity grid (fractions of distinct blocks) of the reference curves.
REFERENCE_GRID = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4)


@dataclass(frozen=True)
class CompareConfig:
    """Settings of ``compare``; each field is a flag (``--policies`` ...).

    ``policies``, ``capacities``: comma-separated lists.  ``main_capacity``:
    the capacity (as written in ``capacities``) of the time and latency plots;
    ``None`` = the middle one.  ``out_dir``: where everything is written.
    """

    policies: str = "none,ttl-pin,session-pin"
    capacities: str = "0.05,0.1,0.2"
    main_capacity: str | None = None
    out_dir: str = "results/compare"
    plots: bool = True
    oracle_model: bool = True

    def policy_list(self) -> list[str]:
        out = [p.strip() for p in self.policies.split(",") if p.strip()]
        bad = [p for p in out if p not in RETENTIONS]
        if bad or not out:
            raise ValueError(f"policies must be a list of {', '.join(RETENTIONS)}, "
                             f"got {self.policies!r}")
        return out

    def capacity_list(self, distinct: int) -> list[tuple[str, int]]:
        """``(label, blocks)`` per capacity; fractions are of ``distinct`` blocks."""
        out = []
        for part in (p.strip() for p in self.capacities.split(",")):
            if not part:
                continue
            v = float(part)
            if v <= 0:
                raise ValueError(f"capacities must be > 0, got {part}")
            blocks = max(1, round(v * distinct)) if v <= 1 else int(v)
            out.append((part, blocks))
        if not out:
            raise ValueError("no capacity given")
        return out


def add_compare_flags(p: argparse.ArgumentParser) -> None:
    """Add the :class:`CompareConfig` flags to ``p``."""
    d = CompareConfig()
    p.add_argument("--policies", default=d.policies,
                   help=f"comma-separated retention policies ({', '.join(RETENTIONS)}) "
                        "(default: %(default)s)")
    p.add_argument("--capacities", default=d.capacities,
                   help="comma-separated capacities: fractions of the trace's distinct blocks "
                        "(<= 1) or block counts (default: %(default)s)")
    p.add_argument("--main-capacity", default=d.main_capacity,
                   help="capacity (as written in --capacities) of the time and latency "
                        "plots (default: the middle one)")
    p.add_argument("--out-dir", default=d.out_dir,
                   help="output directory (default: %(default)s)")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=d.plots,
                   help="write PNG plots (needs matplotlib) (default: on)")
    p.add_argument("--oracle-model", action=argparse.BooleanOptionalAction,
                   default=d.oracle_model,
                   help="also model clairvoyant session pins (default: on)")


def compare_config_from_args(args: argparse.Namespace) -> CompareConfig:
    """CompareConfig from parsed arguments."""
    return CompareConfig(**{f.name: getattr(args, f.name)
                            for f in dataclasses.fields(CompareConfig)})


def _run_row(policy: str, label: str, blocks: int, res: dict[str, Any], path: Path
             ) -> dict[str, Any]:
    lat = res["latency_us"]
    mp_ = res["master_process"]
    model = res["references"].get("model")
    timeline = res.get("timeline") or []
    pinned = [r["soft_pinned_keys"] for r in timeline if r.get("soft_pinned_keys") is not None]
    saved = res.get("prefill_saved") or {}
    return {
        "policy": policy, "capacity": label,
        "capacity_blocks": res.get("stated_capacity_blocks", res["reference_capacity_blocks"]),
        "effective_capacity_blocks": res["reference_capacity_blocks"],
        "requested_blocks": blocks,
        "hit_rate": res["prefix_hit_rate"],
        "model_hit_rate": model["hit_rate"] if model else res["references"]["lru"]["hit_rate"],
        "lru_hit_rate": res["references"]["lru"]["hit_rate"],
        "belady_hit_rate": res["references"].get("belady", {}).get("hit_rate"),
        "cross_worker_hit_fraction": res["cross_worker_hit_fraction"],
        "evictions": res["evictions"], "evicted_pinned": res["evicted_pinned"],
        "max_pinned_keys": max(pinned) if pinned else None,
        "requests_per_s": res["requests_per_s"],
        "p99_us": {op: s["p99_us"] for op, s in lat.items()},
        "p50_us": {op: s["p50_us"] for op, s in lat.items()},
        "verification_failures": res["verification_failures"],
        "saved_tokens_per_request": saved.get("tokens_per_request"),
        "ttft_saved_ms": saved.get("ttft_saved_ms"),
        "saved_fraction": saved.get("saved_fraction"),
        "late_misses": res["late_misses"],
        "sessions_created": res["sessions"]["planned"]["created"],
        "sessions_left_behind": res["sessions"]["left_behind"],
        "master_cpu_utilization": mp_.get("cpu_utilization"),
        "master_rss_peak_bytes": mp_.get("rss_bytes_peak"),
        "wall_s": res["wall_s"],
        "file": path.name,
    }


def compare_table(doc: dict[str, Any]) -> str:
    """Markdown table of a ``compare.json`` document."""
    lines = [
        "| capacity | policy | hit rate | model | exact LRU | "
        "Belady | gap closed | tokens saved/req p50 / p99 | TTFT saved ms p50 / p99 | "
        "cross-worker hits | evictions (pinned) | req/s | p99 request ms | verify fail |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: |",
    ]
    for r in doc["runs"]:
        lru, bel = r["lru_hit_rate"], r["belady_hit_rate"]
        gap = ((r["hit_rate"] - lru) / (bel - lru)
               if bel is not None and bel - lru > 1e-12 else None)
        p99 = r["p99_us"].get("request")
        eff = r.get("effective_capacity_blocks", r["capacity_blocks"])
        tok, ttft = r.get("saved_tokens_per_request"), r.get("ttft_saved_ms")
        lines.append(
            f"| {r['capacity']} ({r['capacity_blocks']:,} / {eff:,}) | {r['policy']} | "
            f"{r['hit_rate']:.2%} | {r['model_hit_rate']:.2%} | {lru:.2%} | "
            f"{'n/a' if bel is None else format(bel, '.2%')} | "
            f"{'n/a' if gap is None else format(gap, '.0%')} | "
            + ("n/a | n/a | " if tok is None or ttft is None else
               f"{tok['p50']:,.0f} / {tok['p99']:,.0f} | "
               f"{ttft['p50']:,.0f} / {ttft['p99']:,.0f} | ")
            + f"{r['cross_worker_hit_fraction']:.0%} | "
            f"{r['evictions'] if r['evictions'] is not None else 'n/a':,} "
            f"({r['evicted_pinned'] if r['evicted_pinned'] is not None else 'n/a':,}) | "
            f"{r['requests_per_s']:,.0f} | "
            f"{'n/a' if p99 is None else format(p99 / 1000, '.1f')} | "
            f"{r['verification_failures']} |")
    oracle = doc.get("oracle_model")
    if oracle:
        lines.append("")
        lines.append("Clairvoyant session pins (model, not a policy): " + ", ".join(
            f"{c}: {v:.2%}" for c, v in oracle.items()))
    lines.append("")
    lines.append("Capacity: label (stated blocks / effective blocks).  Exact LRU, Belady and "
                 "the model run at the effective capacity: the segments' blocks times the "
                 "master's high watermark.")
    return "\n".join(lines)


def _effective(config: LoadgenConfig, blocks: int) -> int:
    return replace(config, capacity_blocks=blocks).effective_capacity_blocks


def _references(requests: list[Request], distinct: int, caps: list[tuple[str, int]],
                config: LoadgenConfig, oracle: bool) -> tuple[dict, dict]:
    """Reference curves over cache sizes (the grid and each run's effective capacity), and
    the clairvoyant model at each run's effective capacity."""
    grid = sorted({max(1, round(f * distinct)) for f in REFERENCE_GRID}
                  | {_effective(config, b) for _, b in caps})
    curves: dict[str, dict[int, float]] = {"lru": {}, "belady": {}}
    for b in grid:
        curves["lru"][b] = lru_prefix_hit_rate(requests, b).hit_rate
        curves["belady"][b] = belady_prefix_hit_rate(requests, b).hit_rate
    oracle_model: dict[str, float] = {}
    if oracle:
        pol = replace(config, retention="session-oracle").session_policy()
        for label, b in caps:
            oracle_model[label] = policy_prefix_hit_rate(requests, _effective(config, b),
                                                         pol).hit_rate
    return curves, oracle_model


def run_compare(config: LoadgenConfig, cc: CompareConfig) -> int:
    """Run the matrix, write the outputs, print the table; returns the exit code."""
    assert config.trace is not None
    requests = load_config_trace(config)
    distinct = len({h for r in requests for h in r.hash_ids})
    policies = cc.policy_list()
    caps = cc.capacity_list(distinct)
    labels = [c for c, _ in caps]
    main = cc.main_capacity if cc.main_capacity is not None else labels[len(labels) // 2]
    if main not in labels:
        raise ValueError(f"main capacity {main!r} is not one of {', '.join(labels)}")
    out = Path(cc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves, oracle_model = _references(requests, distinct, caps, config, cc.oracle_model)
    doc: dict[str, Any] = {
        "trace": config.trace, "limit": config.limit, "requests": len(requests),
        "distinct_blocks": distinct, "policies": policies,
        "capacities": {label: b for label, b in caps},
        "effective_capacities": {label: _effective(config, b) for label, b in caps},
        "main_capacity": main,
        "config": dataclasses.asdict(config),
        "reference_curves": {k: {str(b): v for b, v in c.items()} for k, c in curves.items()},
        "oracle_model": oracle_model, "runs": [], "main_runs": {},
    }
    for label, blocks in caps:
        for policy in policies:
            path = out / f"{policy}-{label}.json"
            cfg = replace(config, retention=policy, capacity_blocks=blocks, json_path=str(path))
            logger.info("compare: %s at capacity %s (%d blocks)", policy, label, blocks)
            print(f"== {policy}, capacity {label} ({blocks:,} blocks)", flush=True)
            res = run_replay(cfg, requests)
            print(format_summary(res), flush=True)
            doc["runs"].append(_run_row(policy, label, blocks, res, path))
            if label == main:
                doc["main_runs"][policy] = {
                    "timeline": res["timeline"], "hit_rate_by_time": res["hit_rate_by_time"],
                    "latency_histograms": res["latency_histograms"],
                    "block_bytes": config.block_bytes}
    (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    table = compare_table(doc)
    (out / "compare.md").write_text(table + "\n", encoding="utf-8")
    print(table)
    if cc.plots:
        from .plots import write_plots

        for p in write_plots(doc, out):
            print(f"wrote {p}")
    bad = sum(r["verification_failures"] for r in doc["runs"])
    return 1 if bad else 0
