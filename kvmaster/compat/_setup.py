"""Set-up and teardown of the facade (Mooncake ``store_py.cpp``: ``setup`` in its two
overloads, ``init_all``, ``get_hostname``, ``health_check``, ``close``;
``real_client.cpp``: ``RealClient::setup_real``, ``setup_internal``, ``initAll``,
``health_check``, ``get_hostname``).

What kvmaster accepts and cannot honour is reported once in the log
(:func:`~kvmaster.compat._common.report_once`), never served as something else: an
RDMA (or any non-TCP) protocol and its device names (bytes move through shared
memory on a host and kvmaster's TCP transfer service between hosts), a Transfer
Engine object, SSD offload, the client HTTP server, an IPC socket path.
"""

from __future__ import annotations

import ctypes
import inspect
import ipaddress
import random
import socket
import threading
import weakref
from typing import Any

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._core import ClientConfig
from kvmaster.client import Client
from kvmaster.compat._common import Facade, code_of, log, report_once
from kvmaster.compat._mooncake_config import KNOWN_PROTOCOLS, parse_bool, parse_size
from kvmaster.protocol import Op, Status

#: Mooncake's defaults and bounds (``types.h``).
DEFAULT_SEGMENT_SIZE = 16 << 20
MIN_SEGMENT_SIZE = 1 << 10
MAX_SEGMENT_SIZE = 1 << 40
DEFAULT_MASTER = "127.0.0.1:50051"
#: Ports Mooncake picks from for a ``local_hostname`` without one (real_client.cpp,
#: ``MC_STORE_CLIENT_MIN_PORT`` / ``MAX_PORT`` defaults).
PORT_RANGE = (12300, 14300)
_PORT_TRIES = 20

#: ``health_check`` results (store_py.cpp).
HC_HEALTHY, HC_NOT_INITIALIZED, HC_MASTER_UNREACHABLE = 0, 1, 2
#: Seconds ``health_check`` waits for the master's answer.
HEALTH_TIMEOUT_S = 1.0

#: Keys the config-dict ``setup`` reads (types.h ``CONFIG_KEY_*`` and real_client.cpp).
DICT_KEYS = frozenset({"local_hostname", "metadata_server", "global_segment_size",
                       "local_buffer_size", "protocol", "rdma_devices", "master_server_addr",
                       "ipc_socket_path", "enable_ssd_offload", "ssd_offload_path",
                       "tenant_id", "enable_client_http_server", "client_http_port"})
#: MooncakeConfig's names for two of them, taken as well.
DICT_ALIASES = {"master_server_address": "master_server_addr", "device_name": "rdma_devices"}

# get_hostname() name -> the native segment of the store that registered it (this
# process): what a ``preferred_segment`` or ``segment_name`` naming it means.
_hostnames: dict[str, str] = {}
_hostnames_lock = threading.Lock()


def segment_name_for(name: str) -> str:
    """The kvmaster segment behind a Mooncake segment name (a ``get_hostname()`` of a
    store of this process), else ``name`` itself."""
    with _hostnames_lock:
        return _hostnames.get(name, name)


class _LocalBufferClient(Client):
    """The native client of a set-up store, with Mooncake's local buffer: the calls
    that copy a value through the client's buffer in Mooncake (put, put_parts,
    put_batch, upsert, upsert_parts, upsert_batch of bytes; get, get_batch,
    get_buffer) fail as Mooncake's do when their bytes do not fit in
    ``local_buffer_size`` (0: every one fails).  The zero-copy forms (``*_from``,
    ``*_into``, registered buffers) do not use it.  Concurrent calls are not summed:
    each call is checked against the whole buffer."""

    def __init__(self, config: ClientConfig, local_buffer_size: int) -> None:
        super().__init__(config)
        self.local_buffer_size = local_buffer_size

    def _fits(self, n: int, op: str) -> None:
        if n > self.local_buffer_size:
            raise E.InvalidParams(f"{n} bytes do not fit in the local buffer "
                                  f"(local_buffer_size={self.local_buffer_size})", op=op)

    @staticmethod
    def _nbytes(values: Any) -> int:
        total = 0
        for v in values:
            if isinstance(v, memoryview) and isinstance(v.obj, (ctypes.Array,
                                                                ctypes._SimpleCData)):
                continue  # a raw pointer's view (the facade's *_from forms): zero-copy
            try:
                total += memoryview(v).nbytes
            except TypeError:
                pass  # the native call refuses it with its own error
        return total

    def put(self, key: str, value: Any, config: Any = None) -> Any:
        self._fits(self._nbytes((value,)), "put")
        return super().put(key, value, config)

    def put_parts(self, key: str, *parts: Any, config: Any = None) -> Any:
        self._fits(self._nbytes(parts), "put_parts")
        return super().put_parts(key, *parts, config=config)

    def put_batch(self, keys: Any, values: Any, config: Any = None) -> Any:
        self._fits(self._nbytes(values), "put_batch")
        return super().put_batch(keys, values, config)

    def upsert(self, key: str, value: Any, config: Any = None) -> Any:
        self._fits(self._nbytes((value,)), "upsert")
        return super().upsert(key, value, config)

    def upsert_parts(self, key: str, *parts: Any, config: Any = None) -> Any:
        self._fits(self._nbytes(parts), "upsert_parts")
        return super().upsert_parts(key, *parts, config=config)  # type: ignore[misc]

    def upsert_batch(self, keys: Any, values: Any, config: Any = None) -> Any:
        self._fits(self._nbytes(values), "upsert_batch")
        return super().upsert_batch(keys, values, config)

    def get(self, key: str) -> Any:
        out = super().get(key)
        self._fits(len(out), "get")
        return out

    def get_buffer(self, key: str) -> Any:
        out = super().get_buffer(key)
        self._fits(memoryview(out).nbytes, "get_buffer")
        return out

    def get_batch(self, keys: Any) -> Any:
        """Values in order while they fit in the local buffer together; None for one
        that does not (Mooncake ``RealClient::batch_get_buffer_internal`` allocates
        per key and skips a key whose buffer cannot be allocated), not the whole
        batch."""
        out = list(super().get_batch(keys))
        room = self.local_buffer_size
        for i, v in enumerate(out):
            if v is not None:
                if len(v) > room:
                    out[i] = None
                else:
                    room -= len(v)
        return out


def _bind_port(host: str) -> tuple[socket.socket, int] | None:
    """A socket bound to a free port of PORT_RANGE (held, as Mooncake holds its
    transfer port, so two stores on a host get two names); None if none was found."""
    lo, hi = PORT_RANGE
    for _ in range(_PORT_TRIES):
        port = random.randint(lo, hi)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("0.0.0.0", port))
            return s, port
        except OSError:
            s.close()
    return None


def _real_signature(local_hostname: str, metadata_server: str, global_segment_size: int,
                    local_buffer_size: int, protocol: str, rdma_devices: str,
                    master_server_addr: str, engine: object = None,
                    enable_ssd_offload: bool = False, ssd_offload_path: str = "",
                    tenant_id: str = "default", enable_client_http_server: bool = False,
                    client_http_port: int = 9300) -> None:
    """The first overload of Mooncake's ``setup`` (store_py.cpp): every name a keyword,
    the first seven required."""


_SIGNATURE = inspect.signature(_real_signature)
_STR_ARGS = ("local_hostname", "metadata_server", "protocol", "rdma_devices",
             "master_server_addr", "ssd_offload_path", "tenant_id")


def _incompatible(why: str) -> TypeError:
    return TypeError(
        f"setup(): incompatible function arguments ({why}). The following argument types "
        "are supported:\n    1. (local_hostname: str, metadata_server: str, "
        "global_segment_size: int, local_buffer_size: int, protocol: str, rdma_devices: str, "
        "master_server_addr: str, engine: object = None, enable_ssd_offload: bool = False, "
        "ssd_offload_path: str = '', tenant_id: str = 'default', "
        "enable_client_http_server: bool = False, client_http_port: int = 9300) -> int\n"
        "    2. (config: dict) -> int")


def transfer_host_for(local_hostname: str, segment_size: int) -> str:
    """The address a store's transfer service binds, so that stores on other hosts can
    read and write its segment: the host part of ``local_hostname`` when it is an IP
    address other than 127.0.0.1 and ::1 (Mooncake's transfer engine listens on
    ``local_hostname`` too), "" (no service: same-host readers only) for a host name,
    a loopback default, or a consumer-only store."""
    if segment_size <= 0:
        return ""
    host = local_hostname.strip()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        report_once("setup-no-transfer", f"setup: local_hostname {local_hostname!r} is not an "
                                         "IP address, so this store's segment is served to "
                                         "stores on this host only; give this host's IP "
                                         "address for stores on other hosts to reach it")
        return ""
    if str(ip) in ("127.0.0.1", "::1"):
        return ""
    return str(ip)


class SetupOps(Facade):
    """``setup``, ``setup_dummy``, ``init_all``, ``alloc_from_mem_pool``,
    ``get_hostname``, ``health_check``, ``close``."""

    _hostname: str = ""
    _port_socket: socket.socket | None = None
    #: The real client's address of a dummy store ("" for a real one).
    _dummy_of: str = ""

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Mooncake's two overloads: ``setup(local_hostname, metadata_server,
        global_segment_size, local_buffer_size, protocol, rdma_devices,
        master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` (positional or by those keywords; the sizes are
        ints, bytes), or ``setup(config)`` with a dict of the same settings whose sizes
        may be strings ("16MB", "3.2 GB"; see
        :mod:`kvmaster.compat._mooncake_config`), every value read as its ``str()``
        as Mooncake does.  Returns 0 or a negative code (INVALID_PARAMS for a bad
        setting or master address, a size over /dev/shm's free space among them);
        raises TypeError for arguments that fit neither overload, as pybind does.

        A store set up again is first closed.  ``get_hostname()`` then names it."""
        if (len(args) == 1 and not kwargs and isinstance(args[0], dict)) or \
                (not args and set(kwargs) == {"config"} and isinstance(kwargs["config"], dict)):
            return self._setup_dict(args[0] if args else kwargs["config"])
        try:
            bound = _SIGNATURE.bind(*args, **kwargs)
        except TypeError as exc:
            raise _incompatible(str(exc)) from None
        bound.apply_defaults()
        a = bound.arguments
        for name in _STR_ARGS:
            if not isinstance(a[name], str):
                raise _incompatible(f"{name} must be a str, not {type(a[name]).__name__}")
        for name in ("global_segment_size", "local_buffer_size", "client_http_port"):
            v = a[name]
            if isinstance(v, float) or not isinstance(v, int) or \
                    (name != "client_http_port" and not 0 <= v < 1 << 64):
                raise _incompatible(f"{name} must be a non-negative int, not {v!r}"
                                    + (" (sizes as strings go in the config-dict form)"
                                       if isinstance(v, str) else ""))
        return self._setup_real(**a)

    def _setup_dict(self, config: dict) -> int:
        """The config-dict overload (real_client.cpp ``setup_internal(ConfigDict)``)."""
        d: dict[str, str] = {}
        for key, value in config.items():
            k = DICT_ALIASES.get(str(key), str(key))
            if k not in DICT_KEYS:
                report_once(f"setup-key-{k}", f"setup: config key {k!r} is not one Mooncake "
                                              "reads; ignored")
                continue
            d.setdefault(k, str(value))
        for k in ("local_hostname", "metadata_server"):
            if not d.get(k):
                log.error("setup: missing required config: %s", k)
                return int(Status.INVALID_PARAMS)
        try:
            gss = parse_size(d.get("global_segment_size", DEFAULT_SEGMENT_SIZE),
                             "global_segment_size")
            lbs = parse_size(d.get("local_buffer_size", DEFAULT_SEGMENT_SIZE),
                             "local_buffer_size")
            port = int(d.get("client_http_port", "9300").strip())
        except ValueError as exc:
            log.error("setup: %s", exc)
            return int(Status.INVALID_PARAMS)
        if gss and gss < MIN_SEGMENT_SIZE:
            log.error("setup: invalid global_segment_size: %d, must be 0 or at least %d",
                      gss, MIN_SEGMENT_SIZE)
            return int(Status.INVALID_PARAMS)
        if lbs and not MIN_SEGMENT_SIZE <= lbs <= MAX_SEGMENT_SIZE:
            log.error("setup: invalid local_buffer_size: %d, must be 0 or between %d and %d",
                      lbs, MIN_SEGMENT_SIZE, MAX_SEGMENT_SIZE)
            return int(Status.INVALID_PARAMS)

        def flag(key: str) -> bool:
            try:
                return parse_bool(d.get(key, "false"))
            except ValueError:
                log.warning("setup: invalid boolean value for config key %r: %s, using "
                            "default: false", key, d[key])
                return False

        if d.get("ipc_socket_path"):
            report_once("setup-ipc", "setup: ipc_socket_path is not used: kvmaster's dummy "
                                     "clients reach a real client through its "
                                     "kvmaster.compat.mooncake_client service")
        return self._setup_real(
            d["local_hostname"], d["metadata_server"], gss, lbs, d.get("protocol", "tcp"),
            d.get("rdma_devices", ""), d.get("master_server_addr", DEFAULT_MASTER), None,
            flag("enable_ssd_offload"), d.get("ssd_offload_path", ""),
            d.get("tenant_id", "default"), flag("enable_client_http_server"), port)

    def _setup_real(self, local_hostname: str, metadata_server: str, global_segment_size: int,
                    local_buffer_size: int, protocol: str, rdma_devices: str,
                    master_server_addr: str, engine: object = None,
                    enable_ssd_offload: bool = False, ssd_offload_path: str = "",
                    tenant_id: str = "default", enable_client_http_server: bool = False,
                    client_http_port: int = 9300) -> int:
        """RealClient::setup_real with kvmaster underneath; 0 or a negative code."""
        if self._client is not None:
            self.close()
        if not local_hostname:
            log.error("setup: local_hostname is empty")
            return int(Status.INVALID_PARAMS)
        proto = protocol.strip().lower()
        if proto not in KNOWN_PROTOCOLS:
            log.error("setup: protocol %r is not one Mooncake installs (%s)", protocol,
                      ", ".join(sorted(KNOWN_PROTOCOLS)))
            return int(Status.INVALID_PARAMS)
        self._report_unserved(proto, rdma_devices, engine, enable_ssd_offload,
                              ssd_offload_path, enable_client_http_server, client_http_port)
        try:
            client = _LocalBufferClient(
                ClientConfig(master_server_addr=master_server_addr,
                             global_segment_size=int(global_segment_size), tenant=tenant_id,
                             transfer_host=transfer_host_for(local_hostname,
                                                             int(global_segment_size))),
                int(local_buffer_size))
        except (TypeError, ValueError) as exc:
            log.error("setup failed: %s", exc)
            return int(Status.INVALID_PARAMS)
        try:
            client.setup()
        except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
            log.error("setup failed: %s", exc)
            try:
                client.close()
            except Exception:  # noqa: BLE001, S110 - the setup's error is the one to return
                pass
            return code_of(exc)
        self._client = client
        self._close_when_dropped(client)
        self._register_hostname(local_hostname, client)
        return 0

    def _close_when_dropped(self, client: Client) -> None:
        """Close ``client`` (segment, threads, sockets) when this store is dropped
        without :meth:`close`, as Mooncake's ``~RealClient`` tears down."""
        self.__dict__["_client_finalizer"] = weakref.finalize(self, client.close)

    def _report_unserved(self, proto: str, rdma_devices: str, engine: object,
                         ssd: bool, ssd_path: str, http: bool, http_port: int) -> None:
        if proto != "tcp":
            report_once(f"setup-protocol-{proto}",
                        f"setup: protocol {proto!r} is not served: kvmaster moves bytes "
                        "through shared memory on a host and its TCP transfer service "
                        "between hosts")
        if rdma_devices and rdma_devices != "auto-discovery" and proto != "tcp":
            report_once("setup-rdma-devices", f"setup: RDMA devices {rdma_devices!r} are not "
                                              "used: kvmaster has no RDMA transport")
        if engine is not None:
            report_once("setup-engine", "setup: the Transfer Engine passed in is not used: "
                                        "kvmaster moves bytes itself")
        if ssd or ssd_path:
            report_once("setup-ssd", "setup: SSD offload is not served by kvmaster: objects "
                                     "stay in memory segments and are evicted from there")
        if http:
            report_once("setup-http", f"setup: the client HTTP server (port {http_port}) is "
                                      "not served; the master's --metrics-port has metrics")

    def _register_hostname(self, local_hostname: str, client: Client) -> None:
        """Mooncake's segment name: ``local_hostname`` as given when it has a port,
        else with a free port of PORT_RANGE (held until close); given to the segment as
        its label on the master."""
        host, sep, port = local_hostname.rpartition(":")
        if sep and port.isdigit() and host and not host.endswith(":"):
            name = local_hostname
        else:
            held = _bind_port(local_hostname)
            if held is None:
                name = local_hostname
            else:
                self._port_socket, p = held
                # A store never closed (an engine's test class) drops it at exit, quietly.
                weakref.finalize(self, held[0].close)
                name = f"{local_hostname}:{p}"
        # The master learns the name as the segment's label (ReplicaOps), so other
        # processes' stores can name this segment too; a name another mounted segment
        # has already is not taken, and the segment then goes by its own name.
        label = getattr(self, "_label_segment", None)
        if client.segment_name and label is not None and not label(name):
            name = client.segment_name
        self._hostname = name
        if client.segment_name:
            with _hostnames_lock:
                _hostnames[name] = client.segment_name

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int,
                    server_address: str) -> int:
        """Mooncake's ``setup_dummy``: use the store of the real client serving at
        ``server_address`` (``host:port`` on this host; see
        :mod:`kvmaster.compat._dummy`): this store then reaches the same master and
        tenant, with no segment of its own, so what it puts is placed in the real
        client's memory.  ``local_buffer_size`` is its local buffer (as in
        :meth:`setup`); ``mem_pool_size`` is not used, as in Mooncake (buffers come
        from :meth:`alloc_from_mem_pool`).  Returns 0, or -1 when no real client
        answers there or it is on another host."""
        from kvmaster.compat import _dummy

        for name, v in (("mem_pool_size", mem_pool_size),
                        ("local_buffer_size", local_buffer_size)):
            if isinstance(v, float) or not isinstance(v, int) or v < 0:
                raise TypeError(f"setup_dummy(): incompatible function arguments ({name} "
                                f"must be a non-negative int, not {v!r})")
        if not isinstance(server_address, str):
            raise TypeError("setup_dummy(): incompatible function arguments (server_address "
                            f"must be a str, not {type(server_address).__name__})")
        if self._client is not None:
            self.close()
        try:
            info = _dummy.query_real_client(server_address)
        except (OSError, ValueError) as exc:
            log.error("setup_dummy: no real client at %s: %s", server_address, exc)
            return -1
        if "error" in info or not isinstance(info.get("master_server_addr"), str):
            log.error("setup_dummy: the real client at %s: %s", server_address,
                      info.get("error", info))
            return -1
        from kvmaster._segment import host_id

        if info.get("host_id") != host_id():
            log.error("setup_dummy: the real client at %s runs on host %r, not this one (%r)",
                      server_address, info.get("host_id"), host_id())
            return -1
        client = _LocalBufferClient(
            ClientConfig(master_server_addr=info["master_server_addr"], global_segment_size=0,
                         tenant=str(info.get("tenant", "default"))), int(local_buffer_size))
        try:
            client.setup()
        except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
            log.error("setup_dummy failed: %s", exc)
            try:
                client.close()
            except Exception:  # noqa: BLE001, S110 - the setup's error is the one to return
                pass
            return -1
        self._client = client
        self._close_when_dropped(client)
        self._dummy_of = server_address
        return 0

    def alloc_from_mem_pool(self, size: int) -> int:
        """Mooncake's ``alloc_from_mem_pool``: the address of ``size`` bytes of shared
        memory for zero-copy calls (``register_buffer`` it first, as Mooncake needs);
        0 when it cannot be mapped.  Each call maps anew; the memory stays mapped for
        the process's life (as Mooncake's ShmHelper keeps it)."""
        from kvmaster.compat._dummy import MEM_POOL

        try:
            return MEM_POOL.allocate(size)
        except (OSError, ValueError) as exc:
            log.error("alloc_from_mem_pool(%r) failed: %s", size, exc)
            return 0

    def init_all(self, protocol: str, device_name: str,
                 mount_segment_size: int = DEFAULT_SEGMENT_SIZE) -> int:
        """Mooncake's ``init_all``: ``setup("localhost:12345", "127.0.0.1:2379",
        mount_segment_size, 1 GiB, protocol, device_name, "127.0.0.1:50051")``;
        INVALID_PARAMS when the store is already set up."""
        if self._client is not None:
            log.error("init_all: the client is already initialized")
            return int(Status.INVALID_PARAMS)
        return self._setup_real("localhost:12345", "127.0.0.1:2379", mount_segment_size,
                                1 << 30, protocol, device_name, DEFAULT_MASTER)

    def get_hostname(self) -> str:
        """The name this store registered (``local_hostname:port``; the port picked
        from 12300-14300 when ``local_hostname`` had none); "" before setup and for a
        dummy store, as in Mooncake."""
        return self._hostname

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 the master does not answer a
        heartbeat within HEALTH_TIMEOUT_S (or, for a dummy store, its real client does
        not answer)."""
        client = self._client
        if client is None:
            return HC_NOT_INITIALIZED
        if not self._master_answers(client):
            return HC_MASTER_UNREACHABLE
        if self._dummy_of:
            from kvmaster.compat._dummy import query_real_client

            try:
                if not query_real_client(self._dummy_of, "ping", 1.0).get("ok"):
                    return HC_MASTER_UNREACHABLE
            except (OSError, ValueError):
                return HC_MASTER_UNREACHABLE
        return HC_HEALTHY

    @staticmethod
    def _master_answers(client: Client, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        """One HEARTBEAT answered within ``timeout_s`` (the client's lock taken within
        it too), on the connection the client has (no re-handshake)."""
        if not client._lock.acquire(timeout=timeout_s):
            return False
        try:
            if client.welcome is None or client._sock is None:
                return False
            client._exchange([(Op.HEARTBEAT.value, P.MASTER_ROUTE, [])], timeout_s)
            return True
        except E.KVMasterError:
            return False
        finally:
            client._lock.release()

    def close(self) -> int:
        """Unmount the segment (its objects go), leave the master; 0.  Idempotent."""
        client, self._client = self._client, None
        fin = self.__dict__.pop("_client_finalizer", None)
        if fin is not None:
            fin.detach()
        with _hostnames_lock:
            _hostnames.pop(self._hostname, None)
        self._hostname = ""
        self._dummy_of = ""
        if self._port_socket is not None:
            self._port_socket.close()
            self._port_socket = None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("close: %s", exc)
        return 0
