"""One SGLang worker's HiCache storage for the eight-worker session test: a
:class:`kvmaster.hicache.KvmasterHiCacheStorage` over a stand-in MHA host pool,
driven by JSON lines on stdin, one JSON reply line per command on stdout.

``python -m tests.engines.hicache_worker MASTER_ADDR GRACE_S``.  Commands (``keys``
are page hashes, ``sid`` a session id or null):

* ``{"op": "lookup", "keys": [...], "sid": ...}``: what HiCache's controller does for
  one request: ``batch_exists`` over the chain, ``batch_get_v1`` of the hits into
  other pages (each compared byte for byte with what its hash gives), then
  ``batch_set_v1`` of the misses from pages filled from their hashes.  Reply
  ``{"hits": n, "bad": pages read wrong, "stored": pages written}``.
* ``begin`` / ``end`` / ``close`` (``sid``), ``update`` (``sid``, ``keys`` kept),
  ``stats`` (the backend's session call counts), ``quit``.
"""

from __future__ import annotations

import json
import sys

from tests.engines import sglang_env


def main() -> None:
    addr, grace = sys.argv[1], float(sys.argv[2])
    hs = sglang_env.load()
    from kvmaster.hicache import KvmasterHiCacheStorage

    store = KvmasterHiCacheStorage(sglang_env.storage_config(
        hs, addr, session_grace_s=grace, global_segment_size="8MB"))
    pool = sglang_env.pool("mha", "page_first", pages=64)
    store.register_mem_pool_host(pool)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op, sid, keys = cmd["op"], cmd.get("sid"), cmd.get("keys", [])
        info = hs.HiCacheStorageExtraInfo(extra_info={"session_id": sid} if sid else None)
        out: dict = {}
        if op == "lookup":
            hits = store.batch_exists(keys, info)
            bad = 0
            if hits:
                ok = store.batch_get_v1(keys[:hits], sglang_env.slots(pool, 32, hits), info)
                bad = sum(not o or sglang_env.read_page(pool, 32 + i) != sglang_env.page_content(
                    keys[i], len(sglang_env.read_page(pool, 32 + i))) for i, o in enumerate(ok))
            miss = keys[hits:]
            for i, h in enumerate(miss):
                sglang_env.fill_page(pool, i, h)
            stored = sum(store.batch_set_v1(miss, sglang_env.slots(pool, 0, len(miss)), info)) \
                if miss else 0
            out = {"hits": hits, "bad": bad, "stored": stored}
        elif op == "begin":
            store.begin_request(sid)
        elif op == "end":
            store.end_request(sid)
        elif op == "update":
            out = {"removed": store.update_session(sid, keys)}
        elif op == "close":
            store.close_session(sid)
        elif op == "stats":
            out = dict(store.session_calls)
        elif op == "quit":
            store.close()
            print(json.dumps({"ok": True}), flush=True)
            return
        print(json.dumps({"ok": True, **out}), flush=True)


if __name__ == "__main__":
    main()
