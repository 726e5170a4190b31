"""``MooncakeConfig``: Mooncake's set-up parameters from a JSON file or the
environment (Mooncake ``mooncake-wheel/mooncake/mooncake_config.py``)."""

from __future__ import annotations
