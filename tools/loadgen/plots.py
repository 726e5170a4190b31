"""PNG plots of a ``compare`` document (matplotlib, Agg backend; imported only for plotting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .stats import OpStats

__all__ = ["write_plots"]

_COLORS = {"none": "tab:gray", "ttl-pin": "tab:orange", "session-pin": "tab:blue",
           "session-oracle": "tab:purple", "lifecycle": "tab:green"}
_CDF_OPS = ("request", "batch_is_exist", "get_batch", "put_batch", "attach", "update", "pin",
            "unpin", "close")


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("plots need matplotlib: pip install 'kvmaster[plots]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _hit_rate_vs_capacity(plt: Any, doc: dict[str, Any], path: Path) -> None:
    distinct = doc["distinct_blocks"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, style in (("lru", ("k", "--", "exact LRU (tool)")),
                        ("belady", ("k", ":", "Belady / clairvoyant (tool)"))):
        pts = sorted((int(b), v) for b, v in doc["reference_curves"][name].items())
        ax.plot([100 * b / distinct for b, _ in pts], [100 * v for _, v in pts],
                color=style[0], linestyle=style[1], label=style[2])
    for policy in doc["policies"]:
        # At the capacity the master keeps, where the reference curves are comparable.
        rows = sorted((r.get("effective_capacity_blocks", r["capacity_blocks"]), r["hit_rate"])
                      for r in doc["runs"] if r["policy"] == policy)
        ax.plot([100 * b / distinct for b, _ in rows], [100 * v for _, v in rows],
                marker="o", color=_COLORS.get(policy), label=f"{policy} (master)")
    oracle = doc.get("oracle_model") or {}
    if oracle:
        caps = doc.get("effective_capacities") or doc["capacities"]
        pts = sorted((caps[c], v) for c, v in oracle.items())
        ax.plot([100 * b / distinct for b, _ in pts], [100 * v for _, v in pts],
                marker="x", linestyle="none", color=_COLORS["session-oracle"],
                label="clairvoyant session pins (model)")
    ax.set_xlabel(f"capacity kept (effective), % of the trace's {distinct:,} distinct blocks")
    ax.set_ylabel("prefix-block hit rate, %")
    ax.set_title(f"{Path(doc['trace']).name}: {doc['requests']:,} requests, "
                 f"{doc['config']['workers']} workers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _over_time(plt: Any, doc: dict[str, Any], path: Path) -> None:
    main = doc["main_capacity"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7.5, 6.4), sharex=True)
    for policy, run in doc["main_runs"].items():
        buckets = [b for b in run["hit_rate_by_time"] if b["hit_rate"] is not None]
        a1.plot([b["t_s"] / 60 for b in buckets], [100 * b["hit_rate"] for b in buckets],
                color=_COLORS.get(policy), label=policy)
        rows = [r for r in run["timeline"] if r.get("soft_pinned_keys") is not None]
        block_mb = run["block_bytes"] / 2**20
        pinned_mb = [r["soft_pinned_bytes"] / 2**20 if r.get("soft_pinned_bytes") is not None
                     else r["soft_pinned_keys"] * block_mb for r in rows]
        a2.plot([r["trace_s"] / 60 for r in rows], pinned_mb, color=_COLORS.get(policy),
                label=f"{policy} (master)")
        planned = [r for r in run["timeline"] if r.get("planned_pinned_blocks")]
        if planned:
            a2.plot([r["trace_s"] / 60 for r in planned],
                    [r["planned_pinned_blocks"] * block_mb for r in planned],
                    color=_COLORS.get(policy), linestyle=":", label=f"{policy} (planned)")
    a1.set_ylabel("prefix hit rate, % (per slice)")
    a1.set_title(f"capacity {main} ({doc['capacities'][main]:,} blocks)")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a2.set_ylabel("pinned MB")
    a2.legend(fontsize=7)
    a2.set_xlabel("trace time, min")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _latency_cdf(plt: Any, doc: dict[str, Any], path: Path) -> None:
    ops = [op for op in _CDF_OPS
           if any(op in run["latency_histograms"] for run in doc["main_runs"].values())]
    cols = 3
    rows = -(-len(ops) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.0 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for policy, run in doc["main_runs"].items():
            h = run["latency_histograms"].get(op)
            if not h:
                continue
            st = OpStats.from_dict(h)
            xs, ys, seen = [], [], 0
            for b in sorted(st.buckets):
                seen += st.buckets[b]
                xs.append(max(b, 1) / 1000.0)
                ys.append(seen / st.count)
            ax.step(xs, ys, where="post", color=_COLORS.get(policy), label=policy)
        ax.set_xscale("log")
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("ms", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"latency CDF per op, capacity {doc['main_capacity']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the three PNGs of a compare document; returns their paths."""
    plt = _plt()
    paths = [out_dir / "hit_rate_vs_capacity.png", out_dir / "over_time.png",
             out_dir / "latency_cdf.png"]
    _hit_rate_vs_capacity(plt, doc, paths[0])
    _over_time(plt, doc, paths[1])
    _latency_cdf(plt, doc, paths[2])
    return paths
