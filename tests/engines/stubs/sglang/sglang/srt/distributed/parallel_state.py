"""Stand-in for ``sglang.srt.distributed.parallel_state``: no shared Mooncake
transfer engine (the store then sets up its own client)."""


def get_mooncake_transfer_engine() -> None:
    return None
