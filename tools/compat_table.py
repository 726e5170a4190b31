"""Write ``docs/compat.md``: every name of Mooncake's ``mooncake.store`` Python surface
(the binding ``mooncake-integration/store/store_py.cpp`` at Mooncake 3b5a594, plus
0.3.14's ``ExistOptions``, ``probe_key``, ``batch_probe_key``, ``get_buffer_info``
and ``ReplicateConfig.session_ids``), and what ``kvmaster.compat`` does with it.

``python -m kvmaster.tools.compat_table`` rewrites the page; ``--check`` exits 1 when
the page is not what this would write (tests/test_compat_surface.py runs it).  The
status column is computed: ``served`` when ``kvmaster.compat`` has the name, and the
note says where it differs from Mooncake; ``accepted, reported`` when it is there but
what it asks for has no counterpart in kvmaster (logged once); ``refused`` when it is
there and answers with an error code; ``absent`` otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

#: Module-level names of ``mooncake.store`` (the binding, and the 0.3.13 wheel's extras).
MODULE = [
    "MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "ObjectDataType",
    "ReplicaStatus", "MemoryDescriptor", "DiskDescriptor", "ReplicaDescriptor", "Descriptor",
    "TaskType", "TaskStatus", "QueryTaskResponse", "BufferHandle", "MooncakeHostMemAllocator",
    "ParallelAxis", "TensorParallelism", "ReadTarget", "MooncakeDistributedNoFRegister",
    "ExistOptions", "bind_to_numa_node", "get_alloc_func_addr", "get_free_func_addr",
    "_serialize_tensor", "_tensor_metadata_size", "_deserialize_tensor",
    "_get_pyclient_from_wrapper", "BufferPool", "BufferLease", "BufferLeaseView",
    "RegisteredBufferPool", "RegisteredBufferLease", "RegisteredBufferLeaseView",
    "EngramStore", "EngramStoreConfig",
    # the enums' members, exported at module level (pybind11 export_values)
    "UNKNOWN", "KVCACHE", "TENSOR", "WEIGHT", "SAMPLE", "ACTIVATION", "GRADIENT",
    "OPTIMIZER_STATE", "METADATA", "GENERAL", "UNDEFINED", "INITIALIZED", "COMPLETE",
    "REMOVED", "REPLICA_COPY", "REPLICA_MOVE", "PENDING", "PROCESSING", "SUCCESS", "FAILED",
]

#: Methods of ``MooncakeDistributedStore``, in the binding's order.
METHODS = [
    "setup", "setup_dummy", "init_all", "mount_segment", "unmount_segment",
    "allocate_and_mount_segment", "unmount_and_free_segment", "unmount_local_disk_segment",
    "alloc_from_mem_pool", "get", "get_batch", "get_offload_rpc_read_count", "get_buffer",
    "batch_get_buffer", "get_buffer_info", "remove", "remove_by_regex", "remove_all",
    "batch_remove", "is_exist", "batch_is_exist", "probe_key", "batch_probe_key", "close",
    "health_check", "get_size", "batch_get_tensor_with_tp", "get_tensor", "put_tensor_with_tp",
    "batch_put_tensor_with_tp", "put_tensor", "batch_get_tensor", "batch_put_tensor",
    "save_tensor_to_safetensor", "load_tensor_from_safetensor", "pub_tensor",
    "batch_pub_tensor", "pub_tensor_with_tp", "batch_pub_tensor_with_tp", "get_tensor_into",
    "batch_get_tensor_into", "get_tensor_into_cuda", "batch_get_tensor_into_cuda",
    "get_tensor_with_tp_into", "batch_get_tensor_with_tp_into", "put_tensor_from",
    "batch_put_tensor_from", "put_tensor_with_tp_from", "batch_put_tensor_with_tp_from",
    "upsert_tensor", "upsert_tensor_from", "batch_upsert_tensor_from", "batch_upsert_tensor",
    "upsert_pub_tensor", "batch_upsert_pub_tensor", "get_tensor_with_parallelism",
    "batch_get_tensor_with_parallelism", "get_tensor_with_parallelism_into",
    "batch_get_tensor_with_parallelism_into", "put_tensor_with_parallelism",
    "batch_put_tensor_with_parallelism", "put_tensor_with_parallelism_from",
    "batch_put_tensor_with_parallelism_from", "upsert_tensor_with_parallelism",
    "upsert_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism_from",
    "batch_upsert_tensor_with_parallelism", "get_tensor_with_tp", "upsert_from", "batch_upsert_from", "upsert",
    "upsert_parts", "upsert_batch", "register_buffer", "unregister_buffer", "get_into",
    "get_into_ranges", "batch_get_into", "put_from", "put_from_with_metadata",
    "batch_put_from", "put", "put_parts", "put_batch", "get_hostname",
    "batch_put_from_multi_buffers", "batch_get_into_multi_buffers", "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges", "batch_get_session_end", "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges", "batch_put_session_end", "batch_put_session_revoke",
    "get_replica_desc", "batch_get_replica_desc", "batch_replica_clear", "create_copy_task",
    "create_move_task", "query_task",
]

#: Names of the surface kvmaster does not provide (each has its note).
NOT_PROVIDED: frozenset[str] = frozenset()

#: ``ReplicateConfig`` fields.
FIELDS = [
    "replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_action", "soft_pin_ttl_ms",
    "with_hard_pin", "preferred_segments", "preferred_nof_segments", "preferred_segment",
    "prefer_alloc_in_same_node", "data_type", "group_ids", "session_ids",
]

#: name -> (status override or "", note).  A status override is one of
#: "accepted, reported" and "refused"; "" keeps the computed one.
NOTES: dict[str, tuple[str, str]] = {
    # module
    "MooncakeHostMemAllocator": ("", "host memory from the store's shared-memory pool "
                                     "(dummy clients: the real client's)"),
    "ExistOptions": ("", "0.3.14 (Mooncake PR #3801)"),
    "bind_to_numa_node": ("", "CPU affinity to the node's CPUs; memory is not bound"),
    "get_alloc_func_addr": ("", "libc `malloc` (Mooncake's allocates huge pages)"),
    "get_free_func_addr": ("", "libc `free`"),
    "DiskDescriptor": ("", "the type only: kvmaster keeps no disk replicas"),
    "MooncakeDistributedNoFRegister": ("refused", "no NVMe-oF tier: NOT_SUPPORTED (-1012)"),
    "_get_pyclient_from_wrapper": ("", "the native `kvmaster.Client`"),
    "_serialize_tensor": ("", "Mooncake's byte layout (304-byte header, then the data)"),
    "BufferPool": ("", "Mooncake 0.3.13's leases of registered host buffers, with its "
                       "arguments, bounds and RuntimeError messages; regions are anonymous "
                       "mmaps registered with the store (no local-buffer allocator), and "
                       "released ones are kept per size class for reuse (`prewarm` maps "
                       "them ahead; Mooncake's frees at release and does not prewarm)"),
    "BufferLease": ("", "`ptr`, `size`, `buffer` (a new `memoryview`), `release`, a context "
                        "manager; release refuses while a view is alive, as Mooncake's"),
    "BufferLeaseView": ("", "the `obj` of a lease's `memoryview`; `buffer` is another view"),
    "RegisteredBufferPool": ("", "`BufferPool` itself, as in Mooncake"),
    "RegisteredBufferLease": ("", "`BufferLease` itself, as in Mooncake"),
    "RegisteredBufferLeaseView": ("", "`BufferLeaseView` itself, as in Mooncake"),
    "EngramStore": ("", "a layer's embedding tables as objects `engram:l<layer>:h<head>` "
                        "(`batch_put_from`), rows read with `get_into_ranges`, as Mooncake's; "
                        "needs numpy"),
    "EngramStoreConfig": ("", "`table_vocab_sizes`, `embedding_dim`, Mooncake's defaults"),
    "FAILED": ("", "TaskStatus.FAILED, as in Mooncake (the later enum wins the name)"),
    "PROCESSING": ("", "TaskStatus.PROCESSING, as in Mooncake"),
    # set-up
    "setup": ("", "positional, keyword and dict forms; sizes as ints or Mooncake's strings "
                  "(`\"16MB\"`; `\"50%\"` is -600, as Mooncake's parser); protocols other "
                  "than tcp, RDMA devices, an engine object and SSD offload are accepted and "
                  "reported once; `local_buffer_size` 0: copying puts and gets fail, "
                  "zero-copy calls work"),
    "setup_dummy": ("", "through a same-host real client, `python -m "
                        "kvmaster.compat.mooncake_client` (mooncake_client's flags)"),
    "get_hostname": ("", "`localhost:<port>` with a held port of 12300-14300; it names the "
                         "store's segment on the master (a segment label)"),
    "health_check": ("", "one heartbeat within 1 s"),
    "mount_segment": ("refused", "memory at a file path: NOT_SUPPORTED (-1012); kvmaster's "
                                 "segments are its own shared-memory files"),
    "allocate_and_mount_segment": ("", "a second native client of the same tenant holds the "
                                       "segment (at most 16 per store)"),
    "unmount_segment": ("", "as `unmount_and_free_segment`"),
    "unmount_and_free_segment": ("", "its objects are erased, as Mooncake's unmount"),
    "unmount_local_disk_segment": ("accepted, reported", "no local disk segment: 0"),
    "get_offload_rpc_read_count": ("", "always 0: no SSD offload tier"),
    # reads and buffers
    "get_buffer": ("", "a private copy"),
    "batch_get_buffer": ("", "a handle per key, None where missing"),
    "get_buffer_info": ("", "`(address, size)` of a private copy, `(0, 0)` on a miss "
                            "(Mooncake's C++ `RealClient::get_buffer_info`; not in its "
                            "Python binding)"),
    "probe_key": ("", "existence with no read lease and no LRU touch (Mooncake PR #3801)"),
    "batch_probe_key": ("", "as `probe_key`, per key"),
    "register_buffer": ("", "this process's host memory, or CUDA device memory where the "
                            "CUDA runtime loads; a freed address, a range past its mapping "
                            "or a device pointer without CUDA is -600"),
    "put_from": ("", "a device buffer by CUDA"),
    "batch_put_from": ("", "device buffers by CUDA"),
    "get_into": ("", "a device buffer by CUDA"),
    "batch_get_into": ("", "device buffers by CUDA"),
    "upsert_from": ("", "host memory only (-600 for a device buffer)"),
    "batch_upsert_from": ("", "host memory only (-600 for every key when a buffer is not)"),
    "get_into_ranges": ("", "only into registered buffers, as Mooncake"),
    "remove_by_regex": ("", "RE2 syntax, a search (backreferences and lookaround: -600)"),
    "get_tensor_into_cuda": ("", "without CUDA: -600 and a log line; with CUDA through host "
                                 "memory, no CUDA IPC"),
    "batch_get_tensor_into_cuda": ("", "as `get_tensor_into_cuda`"),
    "save_tensor_to_safetensor": ("", "through the `safetensors` package"),
    "load_tensor_from_safetensor": ("", "through the `safetensors` package"),
    # multi-buffer and sessions
    "batch_put_from_multi_buffers": ("", "one copy per buffer, straight into the segment; "
                                         "device buffers by CUDA (four streams, one wait per "
                                         "call)"),
    "batch_get_into_multi_buffers": ("", "one copy per buffer, straight from the segment; "
                                         "device buffers by CUDA"),
    "batch_get_session_start": ("", "holds the read lease; LEASE_EXPIRED (-707) once it ended"),
    "batch_put_session_start": ("", "a split put: start now, ranges copied into the segment, "
                                    "end or revoke later"),
    # replicas and tasks
    "batch_replica_clear": ("", "the caller's own objects whose read lease has ended; a "
                                "segment clears only its replica"),
    "create_copy_task": ("", "run by the requesting store (prepare on the master at once, "
                             "copy and commit on a worker thread); at most 1024 in flight "
                             "(-1401)"),
    "create_move_task": ("", "as `create_copy_task`; the source replica goes after its lease"),
    "query_task": ("", "a task is visible to the store that created it (-1400 elsewhere)"),
    # config fields
    "nof_replica_num": ("accepted, reported", "no NVMe-oF tier"),
    "dfs_replica_num": ("accepted, reported", "no DFS tier"),
    "preferred_nof_segments": ("accepted, reported", "no NVMe-oF tier"),
    "prefer_alloc_in_same_node": ("accepted, reported", "placement is by free space"),
    "preferred_segment": ("", "tried before `preferred_segments`; a segment name or its "
                              "`get_hostname()` label"),
    "data_type": ("", "kept with the config; no effect on placement or eviction"),
    "soft_pin_ttl_ms": ("", "None or an int in [0, 2**64), else TypeError"),
    "session_ids": ("", "Mooncake 0.3.14's attribution tag, one per key: kept with the "
                        "object (`session_tag` in `kvmaster ctl key`, "
                        "`master_session_tagged_writes_total`), no effect on eviction; with "
                        "the master's `--session-tags-as-kv-sessions`, a membership of that "
                        "session instead (the write then carries no `group_ids`)"),
}

#: Mooncake's own Python tests (../shared/engines/mooncake) and what of them cannot apply
#: to kvmaster; tests/engines runs every other test of each file, as Mooncake runs it
#: (tests/test_compat_surface.py checks this list against the harnesses).
MOONCAKE_TESTS: dict[str, dict[str, str]] = {
    "test_distributed_object_store.py": {},
    "test_replicated_distributed_object_store.py": {},
    "test_upsert_api.py": {},
    "test_batch_replica_clear.py": {
        "test_clear_with_active_lease": "assumes a put leaves a read lease on its object; "
        "Mooncake's master grants none at a put's end (`MasterService::PutEnd`), nor does "
        "kvmaster's, so both clear the unread object at once (the lease rule is tested "
        "with a get in tests/engines/test_mooncake_replicas.py)",
        "test_clear_mixed_expired_and_active": "the same assumption for its active keys",
    },
    "test_copy_move_api.py": {},
    "test_dummy_client.py": {
        "test_dummy_cuda_ipc_put_tensor_waits_for_current_stream":
            "CUDA IPC: needs a CUDA GPU and a CUDA build of PyTorch (it skips itself without)",
        "test_dummy_cuda_ipc_batch_put_tensor_waits_for_current_stream":
            "CUDA IPC: needs a CUDA GPU and a CUDA build of PyTorch (it skips itself without)",
    },
    "session_ranges_tcp_e2e.py": {},
}
#: Where each file runs.
MOONCAKE_HARNESS = {
    "test_distributed_object_store.py": "tests/engines/test_mooncake_suite.py",
    "test_replicated_distributed_object_store.py": "tests/engines/test_mooncake_suite.py",
    "test_upsert_api.py": "tests/engines/test_mooncake_suite.py",
    "test_batch_replica_clear.py": "tests/engines/test_mooncake_replicas.py",
    "test_copy_move_api.py": "tests/engines/test_mooncake_replicas.py",
    "test_dummy_client.py": "tests/engines/test_mooncake_dummy.py",
    "session_ranges_tcp_e2e.py": "tests/engines/test_mooncake_session_ranges.py",
}

PAGE = Path(__file__).resolve().parents[1] / "docs" / "compat.md"


def _status(name: str, present: bool) -> tuple[str, str]:
    override, note = NOTES.get(name, ("", ""))
    if not present:
        return "absent", note
    return override or "served", note


def render() -> str:
    import kvmaster.compat as compat
    from kvmaster.compat import MooncakeDistributedStore, ReplicateConfig

    cfg = ReplicateConfig()
    out = ["# kvmaster.compat: Mooncake's Python surface, name by name", "",
           "Generated by `python -m kvmaster.tools.compat_table` (a test fails when this page "
           "is stale). `served`: kvmaster answers it with Mooncake's argument forms, return "
           "values and error codes; the note says where it differs. `accepted, reported`: "
           "the call or field is taken, but what it asks for has no counterpart in kvmaster, "
           "and the first use is logged at WARNING (never served silently as something "
           "else). `refused`: it answers with an error code and a log line. `absent`: not "
           "there (an `AttributeError`, as on a Mooncake build without it).", ""]
    rows = [("`mooncake.store` module", MODULE, lambda n: hasattr(compat, n)),
            ("`MooncakeDistributedStore` methods", METHODS,
             lambda n: callable(getattr(MooncakeDistributedStore, n, None))),
            ("`ReplicateConfig` fields", FIELDS, lambda n: hasattr(cfg, n))]
    for title, names, has in rows:
        counts: dict[str, int] = {}
        lines = []
        for n in names:
            st, note = _status(n, has(n))
            counts[st] = counts.get(st, 0) + 1
            lines.append(f"| `{n}` | {st} | {note} |")
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        out += [f"## {title}", "", f"{len(names)} names: {summary}.", "",
                "| name | status | note |", "|---|---|---|", *lines, ""]
    out += ["## Mooncake's own tests", "",
            "Each file of `../shared/engines/mooncake` runs unmodified against a real master, "
            "as Mooncake runs it; every test of it passes except those named here.", "",
            "| file | run by | tests that cannot apply, and why |", "|---|---|---|"]
    for f, left in MOONCAKE_TESTS.items():
        why = "; ".join(f"`{t}`: {r}" for t, r in left.items()) or "none"
        out.append(f"| `{f}` | `{MOONCAKE_HARNESS[f]}` | {why} |")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmaster.tools.compat_table",
                                description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/compat.md is stale")
    a = p.parse_args(argv)
    text = render()
    if a.check:
        old = PAGE.read_text() if PAGE.exists() else ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True),
                                                       text.splitlines(True),
                                                       "docs/compat.md", "generated"))
            print("docs/compat.md is stale: run python -m kvmaster.tools.compat_table",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(PAGE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
