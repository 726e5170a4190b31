"""Tensor calls of the facade (Mooncake store_py.cpp: put_tensor, get_tensor and their batch, into, from, with_tp and with_parallelism forms)."""

from __future__ import annotations

from kvmaster.compat._common import Facade


class TensorOps(Facade):
    pass
