"""kvmaster's ``mooncake_client``: ``python -m kvmaster.compat.mooncake_client
--master_server_address=HOST:PORT [--port=50052] [--global_segment_size="4 GB"] ...``
sets up a real client and serves the dummy clients of this host (see
:mod:`kvmaster.compat._dummy`; the flags are Mooncake's ``real_client_main.cpp``'s)."""

from __future__ import annotations

import sys

from kvmaster.compat._dummy import main

if __name__ == "__main__":
    sys.exit(main())
