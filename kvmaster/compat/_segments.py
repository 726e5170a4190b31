"""Extra segments of a set-up store (Mooncake ``store_py.cpp``
``allocate_and_mount_segment``, ``unmount_and_free_segment``, ``mount_segment``,
``unmount_segment``, ``unmount_local_disk_segment``, ``get_offload_rpc_read_count``).

kvmaster serves an extra segment as a second native client of the same master and
tenant that contributes the segment (its own shared-memory file, heartbeat and
connection): the master places replicas on it like on any other segment, and
unmounting it closes that client, whose objects go with it, as Mooncake's unmount
erases the objects of the segment.  At most :data:`MAX_EXTRA_SEGMENTS` per store.
"""

from __future__ import annotations

from typing import Any

from kvmaster._core import ClientConfig
from kvmaster.compat._common import Facade, code_of, log, report_once

#: Extra segments one store may hold at once; one more is refused INVALID_PARAMS.
MAX_EXTRA_SEGMENTS = 16
#: Mooncake's NOT_SUPPORTED (``mooncake-store/include/types.h`` ``ErrorCode``).
NOT_SUPPORTED = -1012
INVALID_PARAMS = -600


class SegmentOps(Facade):
    _extra: dict[str, Any] | None = None

    def _extras(self) -> dict[str, Any]:
        if self._extra is None:
            self._extra = {}
        return self._extra

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp",
                                   location: str = "") -> dict[str, Any]:
        """Allocate ``size`` bytes of shared memory and contribute them as a new
        segment -> ``{"ret": 0 or a code, "segment_ids": [name], "allocated_size":
        bytes}``.  ``protocol`` and ``location`` (a NUMA or device hint) are accepted;
        the segment is shared memory on this host whatever they say."""
        from kvmaster.client import Client

        out: dict[str, Any] = {"ret": INVALID_PARAMS, "segment_ids": [], "allocated_size": 0}
        extras = self._extras()
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            log.error("allocate_and_mount_segment: size must be a positive int, not %r", size)
            return out
        if len(extras) >= MAX_EXTRA_SEGMENTS:
            log.error("allocate_and_mount_segment: this store already holds %d extra "
                      "segments (the most)", len(extras))
            return out
        if location:
            report_once("segment-location", f"allocate_and_mount_segment location={location!r}"
                        " is not honoured: kvmaster segments are shared memory on this host")
        base = self.client.config
        sub = Client(ClientConfig(master_server_addr=base.master_server_addr,
                                  global_segment_size=size, tenant=base.tenant,
                                  curve_dir=base.curve_dir, curve_client=base.curve_client))
        try:
            sub.setup()
        except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
            log.error("allocate_and_mount_segment failed: %s", exc)
            out["ret"] = code_of(exc)
            return out
        name = sub.segment_name or ""
        extras[name] = sub
        out.update(ret=0, segment_ids=[name], allocated_size=size)
        return out

    def unmount_and_free_segment(self, segment_ids: list[str],
                                 grace_period_seconds: int = 0) -> int:
        """Unmount segments made by :meth:`allocate_and_mount_segment` (their objects
        are erased) and free their memory -> 0, or INVALID_PARAMS naming an id this
        store did not mount (the others are still unmounted)."""
        extras = self._extras()
        rc = 0
        for sid in list(segment_ids):
            sub = extras.pop(sid, None)
            if sub is None:
                log.error("unmount: segment %r was not mounted by this store", sid)
                rc = INVALID_PARAMS
                continue
            sub.close()
        return rc

    def unmount_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        """As :meth:`unmount_and_free_segment`: a kvmaster segment's memory is never
        kept past its unmount."""
        return self.unmount_and_free_segment(segment_ids, grace_period_seconds)

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict[str, Any]:
        """Mooncake mounts memory at a file ``path`` (a DAX device, a file) as a segment;
        kvmaster's segments are its own shared-memory files, which other clients map
        by name, so this is refused: ``{"ret": NOT_SUPPORTED (-1012), "segment_ids":
        []}`` and a log line.  Use :meth:`allocate_and_mount_segment`."""
        log.error("mount_segment(%r) is not supported by kvmaster: segments are kvmaster's "
                  "own shared-memory files; use allocate_and_mount_segment(size)", path)
        return {"ret": NOT_SUPPORTED, "segment_ids": []}

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """kvmaster has no local-disk (SSD offload) segment: 0, reported once."""
        report_once("no-disk-segment", "unmount_local_disk_segment: kvmaster has no local "
                                        "disk segment (no SSD offload tier); nothing to do")
        return 0

    def get_offload_rpc_read_count(self) -> int:
        """Reads served from an SSD offload tier: always 0 (kvmaster has none)."""
        return 0

    def _close_extras(self) -> None:
        for sub in list(self._extras().values()):
            try:
                sub.close()
            except Exception:  # noqa: BLE001
                pass
        self._extras().clear()
