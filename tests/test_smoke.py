from __future__ import annotations

import pytest

from kvmaster import ObjectHasLease, ObjectNotFound


def test_put_get_remove(client) -> None:
    client.put("k", b"v" * 100)
    assert client.get("k") == b"v" * 100
    assert client.is_exist("k")
    with pytest.raises(ObjectHasLease):
        client.remove("k")
    client.remove("k", force=True)
    with pytest.raises(ObjectNotFound):
        client.get("k")
