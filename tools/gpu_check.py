"""Save and load a vLLM-shaped KV cache in GPU memory through kvmaster, on a GPU machine.

The cache is ``--layers`` layers of K and V, each a CUDA tensor of ``--blocks``
blocks; block ``b``'s object gathers its piece of every layer's K and V (2 x layers
buffers, ``--block-bytes`` in all), as vLLM's MooncakeStoreConnector saves it.  The
check starts a master, then for each path saves every block, zeroes the cache, loads
every block and compares every byte with a copy:

* ``compat``: ``register_buffer`` of each tensor, ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers`` (vLLM's calls, kvmaster.compat);
* ``native``: ``Client.batch_put_from_device`` / ``batch_get_into_device``;

each with the segment page-locked (``cudaHostRegister``) and without.  The floor is
``cudaMemcpy`` of the same bytes between page-locked host memory and the device
(torch's ``copy_``).  Prints GB/s each way and the ratio to the floor, and writes
``--json``.  Exits 2, saying why, where torch has no CUDA device.

    python -m tools.gpu_check                      # 32 layers, 2 MiB blocks, 512 blocks
    python -m tools.gpu_check --blocks 64 --json /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _HostAsDevice:
    """``--dry-run-cpu``: a runtime that takes host memory for device memory, so the
    script's flow runs on a machine with no GPU (its figures mean nothing)."""

    def kind(self, ptr: int) -> Any:
        from kvmaster._cuda import PointerKind

        return PointerKind.DEVICE

    def copy_batch(self, copies: Any) -> None:
        import ctypes

        for dst, src, n in copies:
            ctypes.memmove(dst, src, n)

    def register_host(self, ptr: int, size: int) -> bool:
        return True

    def unregister_host(self, ptr: int) -> None:
        return None


def _floor(torch: Any, nbytes: int, runs: int, device: str) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    best = {"save": 0.0, "load": 0.0}
    for _ in range(runs):
        _sync(torch, device)
        t = time.perf_counter()
        host.copy_(dev)
        _sync(torch, device)
        best["save"] = max(best["save"], _gbps(nbytes, time.perf_counter() - t))
        t = time.perf_counter()
        dev.copy_(host)
        _sync(torch, device)
        best["load"] = max(best["load"], _gbps(nbytes, time.perf_counter() - t))
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-bytes", type=int, default=2 << 20,
                    help="bytes of one block over all layers' K and V (default 2 MiB)")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3, help="runs of each measurement (best kept)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run the flow on CPU tensors with host memory taken for device "
                         "memory (a check of the script; its figures mean nothing)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed", file=sys.stderr)
        return 2
    from kvmaster import _cuda
    from kvmaster.compat import MooncakeDistributedStore

    device = "cuda"
    if args.dry_run_cpu:
        device = "cpu"
        _cuda.use_runtime(_HostAsDevice())
    elif not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device on this machine", file=sys.stderr)
        return 2

    piece = args.block_bytes // (2 * args.layers)
    if piece <= 0 or piece * 2 * args.layers != args.block_bytes:
        print("gpu_check: --block-bytes must split evenly over 2 x --layers buffers",
              file=sys.stderr)
        return 2
    total = piece * 2 * args.layers * args.blocks
    kv = [torch.randint(0, 256, (args.blocks, piece), dtype=torch.uint8, device=device)
          for _ in range(2 * args.layers)]
    saved = [t.clone() for t in kv]
    ptrs = [[t[b].data_ptr() for t in kv] for b in range(args.blocks)]
    sizes = [[piece] * len(kv)] * args.blocks
    master = subprocess.Popen([sys.executable, "-m", "kvmaster", "master", "--port", "0",
                               "--metrics-port", "-1"], stdout=subprocess.PIPE, text=True)
    line = master.stdout.readline() if master.stdout else ""
    addr = line.rsplit(" ", 1)[-1].strip().removeprefix("tcp://")
    segment = int(total * 1.3) + (64 << 20)
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "none (dry run)",
        "layers": args.layers,
        "block_bytes": args.block_bytes, "blocks": args.blocks, "bytes": total,
        "floor_gbps": _floor(torch, total, args.runs, device), "paths": {}}
    failures = 0
    try:
        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 << 20, "tcp", "", addr):
            raise SystemExit("gpu_check: the store's setup failed")
        for t in kv:
            assert store.register_buffer(t.data_ptr(), t.numel()) == 0
        native = store.client  # (its segment: the direct path, as the facade's)
        paths = {
            "compat": (lambda ks: store.batch_put_from_multi_buffers(ks, ptrs, sizes),
                       lambda ks: store.batch_get_into_multi_buffers(ks, ptrs, sizes)),
            "native": (lambda ks: native.batch_put_from_device(ks, ptrs, sizes),
                       lambda ks: native.batch_get_into_device(ks, ptrs, sizes)),
        }
        for register in (True, False):
            _cuda.HOST_REGISTER = register
            rt = _cuda.runtime()
            if not register and rt is not None:
                for addr_ in list(getattr(rt, "_registered", {})):
                    rt.unregister_host(addr_)
            for name, (save, load) in paths.items():
                best = {"save": 0.0, "load": 0.0}
                for run in range(args.runs):
                    keys = [f"gpu-check-{name}-{register}-{run}-{b}" for b in range(args.blocks)]
                    _sync(torch, device)
                    t0 = time.perf_counter()
                    put = save(keys)
                    best["save"] = max(best["save"], _gbps(total, time.perf_counter() - t0))
                    for t in kv:
                        t.zero_()
                    _sync(torch, device)
                    t0 = time.perf_counter()
                    got = load(keys)
                    best["load"] = max(best["load"], _gbps(total, time.perf_counter() - t0))
                    bad = sum(not torch.equal(a, b) for a, b in zip(kv, saved))
                    if any(p != 0 for p in put) or any(g != args.block_bytes for g in got) or bad:
                        failures += 1
                        print(f"gpu_check: {name} run {run}: put {set(put)}, get {set(got)}, "
                              f"{bad} tensors differ", file=sys.stderr)
                    for t, s in zip(kv, saved):
                        t.copy_(s)
                    native.batch_remove(keys, True)
                results["paths"][f"{name}, host registration {'on' if register else 'off'}"] = best
        store.close()
    finally:
        master.terminate()
        master.wait(timeout=30)
    fl = results["floor_gbps"]
    print(f"{results['gpu']}: {args.layers} layers x K,V, {args.blocks} blocks of "
          f"{args.block_bytes} B ({total / 2**30:.2f} GiB); floor cudaMemcpy pinned "
          f"D2H {fl['save']:.1f} GB/s, H2D {fl['load']:.1f} GB/s")
    print(f"{'path':<36}{'save GB/s':>11}{'of floor':>10}{'load GB/s':>11}{'of floor':>10}")
    for name, r in results["paths"].items():
        print(f"{name:<36}{r['save']:>11.1f}{r['save'] / fl['save']:>10.0%}"
              f"{r['load']:>11.1f}{r['load'] / fl['load']:>10.0%}")
    results["verification_failures"] = failures
    print(f"verification failures: {failures}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("KVMASTER_CUDA", "on")
    sys.exit(main())
