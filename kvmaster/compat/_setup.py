"""Set-up and teardown of the facade (Mooncake ``store_py.cpp`` ``setup``,
``close``; ``real_client.cpp`` ``RealClient::setup_real``)."""

from __future__ import annotations

from typing import Any

from kvmaster._core import ClientConfig
from kvmaster.client import Client
from kvmaster.compat._common import Facade, code_of, log


class SetupOps(Facade):
    def setup(self, local_hostname: Any = "", metadata_server: str = "P2PHANDSHAKE",
              global_segment_size: int = 16 << 20, local_buffer_size: int = 16 << 20,
              protocol: str = "shm", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051", engine: object = None,
              *args: Any, tenant_id: str = "default", **kwargs: Any) -> int:
        """Mooncake's positional setup, or a dict as the only argument.

        ``local_hostname`` (an address for Mooncake's transfer engine, often
        "localhost"), ``metadata_server``, ``local_buffer_size``, ``protocol`` and
        ``rdma_devices`` are accepted and ignored: the host identity that decides
        whether a segment is mapped directly is the machine's hostname.  Returns 0
        or a negative code.
        """
        if isinstance(local_hostname, dict):
            d = local_hostname
            local_hostname = d.get("local_hostname", "")
            global_segment_size = int(d.get("global_segment_size", global_segment_size))
            master_server_addr = d.get("master_server_addr", d.get("master_server_address",
                                                                   master_server_addr))
            tenant_id = d.get("tenant_id", tenant_id)
        client = Client(ClientConfig(master_server_addr=master_server_addr,
                                     global_segment_size=int(global_segment_size),
                                     tenant=tenant_id))
        try:
            client.setup()
        except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
            log.error("setup failed: %s", exc)
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
            return code_of(exc)
        self._client = client
        return 0

    def close(self) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        return 0
