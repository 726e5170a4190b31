"""Multi-buffer, ranged and ranged-write-session calls of the facade (Mooncake store_py.cpp: batch_put_from_multi_buffers, batch_get_into_multi_buffers, get_into_ranges, batch_get_into_multi_buffer_ranges, batch_put_session_*, batch_get_session_*)."""

from __future__ import annotations

from kvmaster.compat._common import Facade


class MultiBufferOps(Facade):
    pass
