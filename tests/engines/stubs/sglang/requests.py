"""Stand-in for ``requests`` (imported by SGLang's mooncake_store.py, used only by
its ``check_server``, which the harness leaves off): any request fails."""


def get(url: str, timeout: float | None = None) -> None:
    raise ConnectionError(f"requests stand-in: no HTTP in the test harness ({url})")
