"""Stand-in parent package for ``vllm.distributed.mooncake_store``."""
