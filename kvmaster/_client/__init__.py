"""The client side's internals, one concern per module; assembled in
:class:`kvmaster._core.ClientCore` and driven by :mod:`kvmaster.client` and
:mod:`kvmaster.aio`."""
