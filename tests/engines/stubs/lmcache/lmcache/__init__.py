"""Stand-in for the ``lmcache`` package (only what the Mooncake connector imports)."""

from types import SimpleNamespace

#: ``lmcache.torch_dev``: the accelerator facade; these tests run on CPU only.
torch_dev = SimpleNamespace(current_device=lambda: 0)
