"""Test stand-in for ``sglang.srt.mem_cache``: ``hicache_storage`` and
``storage.mooncake_store.mooncake_store`` are SGLang's real files, loaded by the
harness (tests/engines/test_sglang.py) under these names."""
