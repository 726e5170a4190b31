"""``--client-factory tests.engines.hicache_loadgen:client`` for ``kvmaster-loadgen``:
:class:`kvmaster.hicache.LoadgenClient` with SGLang's own ``hicache_storage.py``
loaded from ``../shared/engines`` over the harness's stand-ins (where SGLang itself
is installed, ``kvmaster.hicache:LoadgenClient`` is the factory)."""

from __future__ import annotations

from typing import Any

from tests.engines import sglang_env


def client() -> Any:
    sglang_env.load()
    from kvmaster.hicache import LoadgenClient

    return LoadgenClient()
