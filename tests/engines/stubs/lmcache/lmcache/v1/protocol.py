"""``lmcache.v1.protocol``: the header LMCache stores in front of a chunk's bytes
when it keeps chunk metadata remotely: native ints ``length, format`` and, per KV
group, ``dtype code, dim0..dim3`` (shorter shapes padded with zeros)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from lmcache.v1.memory_management import MemoryFormat

DTYPE_CODES = {torch.float16: 2, torch.bfloat16: 3, torch.float32: 4, torch.float64: 5,
               torch.uint8: 6}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

_fmt: str | None = None


def init_remote_metadata_info(num_groups: int) -> None:
    global _fmt
    _fmt = "i" * (2 + 5 * num_groups)


def get_remote_metadata_bytes() -> int:
    assert _fmt is not None
    return struct.calcsize(_fmt)


@dataclass
class RemoteMetadata:
    length: int
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    fmt: MemoryFormat

    def serialize(self) -> bytes:
        assert _fmt is not None
        ints = [self.length, self.fmt.value]
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            dims = list(shape) + [0] * (4 - len(shape))
            ints += [DTYPE_CODES[dtype], *dims]
        return struct.pack(_fmt, *ints)

    @staticmethod
    def deserialize(data: bytes | memoryview) -> RemoteMetadata:
        assert _fmt is not None
        ints = struct.unpack_from(_fmt, data)
        shapes, dtypes = [], []
        for i in range(2, len(ints), 5):
            dims = list(ints[i + 1:i + 5])
            while len(dims) > 1 and dims[-1] == 0:
                dims.pop()
            shapes.append(torch.Size(dims))
            dtypes.append(CODE_DTYPES[ints[i]])
        return RemoteMetadata(ints[0], shapes, dtypes, MemoryFormat(ints[1]))
