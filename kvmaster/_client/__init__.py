"""The client side's internals, one concern per module; assembled in
:class:`kvmaster._core.ClientCore` and driven by :mod:`kvmaster.client` and
:mod:`kvmaster.aio`.

The drivers share their retry and round decisions (:mod:`.policy`) and own the
parts that do their I/O: :mod:`.sync_wire`, :mod:`.sync_handshake` and
:mod:`.sync_tasks` for the sync client, :mod:`.aio_handshake` and :mod:`.aio_tasks`
for the asyncio one.  :mod:`.typed_sync` and :mod:`.typed_async` hold the
operations' typed signatures for type checkers (written by
``python -m tools.gen_client_types``)."""
