"""Stand-in for ``sglang.srt.mem_cache.memory_pool_host``: the names the Mooncake
backend imports from it (only for ``isinstance`` checks)."""

from sglang.srt.mem_cache.pool_host import HostKVCache


class DeepSeekV4PagedHostPool(HostKVCache):
    """Never instantiated by the harness."""
