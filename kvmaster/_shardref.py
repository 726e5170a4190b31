"""The master's shards: one surface, whether they run in-process or in processes.

A :class:`ShardRef` is what the front and the registry call on one shard: an
in-process :class:`~kvmaster._shard.ShardActor`, or a
:class:`~kvmaster._shardproc.RemoteShard` standing for a shard process.  The set of
them is a :class:`LocalShards` (actors on the master's event loop) or a
:class:`~kvmaster._shardproc.ShardProcesses` (``--shard-processes``); both offer
``shards``, ``remote``, ``register_client``, ``forget_client`` and ``stop``, so the
per-request and per-client paths need not ask which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvmaster._shard import ShardActor
from kvmaster.config import MasterConfig

if TYPE_CHECKING:
    from kvmaster._shard_oplog import ShardLog


class ShardRef(Protocol):
    """One shard as the master reaches it (event loop thread only)."""

    #: Work queued for the shard: the read loop runs (or sends) it with :meth:`drain`.
    inbox: Any

    @property
    def log(self) -> ShardLog | None:
        """The shard's op log (``--ha-oplog``, in-process shards only), else None."""
        ...

    def deliver(self, envelope: tuple[Any, ...]) -> bool:
        """Queue a client request ``(op, payload, view)``; False at a full inbox."""
        ...

    def post(self, method: str, args: tuple[Any, ...], future: Any = None) -> None:
        """Queue an internal message; its answer resolves ``future`` when given."""
        ...

    def drain(self) -> None:
        """Handle (or send to the shard process) what is queued."""
        ...


class LocalShards:
    """The shard actors of a master without ``--shard-processes``: they run on the
    master's event loop, and see the front's client views directly."""

    #: Requests are handled on this loop (a batch may go to any shard: WELCOME
    #: ``batch_any_shard``).
    remote = False

    def __init__(self, config: MasterConfig, send_reply: Callable[..., None]) -> None:
        self.shards: list[ShardActor] = [
            ShardActor(i, config.shard_count, config, send_reply)
            for i in range(config.shard_count)]
        for shard in self.shards:
            shard.peers = self.shards

    def start(self, waker: Callable[[ShardActor], Callable[[], None]]) -> list[ShardActor]:
        """Give each shard its wake-up (``waker(shard)``); -> the shards."""
        for shard in self.shards:
            shard.wakeup = waker(shard)
            shard.any_shard = True
        return self.shards

    def register_client(self, identity: bytes, client_id: str, tenant: str) -> None:
        """(In-process shards take the client's view with each request.)"""

    def forget_client(self, identity: bytes) -> None:
        """(As :meth:`register_client`.)"""

    def stop(self) -> None:
        """(Nothing to stop: the shards end with the loop.)"""
