"""CURVE authentication and encryption (ZeroMQ's CurveZMQ through ``zmq.auth``).

Key directory layout (``kvmaster keygen DIR --client NAME --tenant T`` makes it)::

    DIR/master.key           master public certificate (every client needs it)
    DIR/master.key_secret    master secret certificate (only the master)
    DIR/clients/NAME.key     allowed client public certificate, metadata tenant = "T"
    DIR/clients/NAME.key_secret   that client's secret certificate (only that client)

The master allows exactly the public keys in ``DIR/clients`` and takes each
client's tenant from its certificate's ``tenant`` metadata, never from what
the client claims in HELLO.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import zmq
import zmq.auth

__all__ = ["allowed_tenants", "client_keys", "keygen", "master_keys"]

_TENANT = re.compile(r'^\s*tenant\s*=\s*"?([^"\n]*?)"?\s*$', re.M)
#: A client name in a key directory: 1-128 of ``[A-Za-z0-9_.-]``.
NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def valid_tenant(tenant: str) -> bool:
    """A tenant bound in a certificate: 1-128 printable characters, no quote, and no
    whitespace at either end (so no name can read as another, ``" default"`` as the
    admin tenant ``default``)."""
    return (0 < len(tenant) <= 128 and tenant.isprintable() and '"' not in tenant
            and tenant == tenant.strip())


def keygen(directory: str | os.PathLike, client: str | None = None,
           tenant: str = "default") -> list[Path]:
    """Create the master key pair if missing and, with ``client``, a client pair bound
    to ``tenant``.  Secret files get mode 0600.  Returns the files written."""
    d = Path(directory)
    written: list[Path] = []
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "master.key_secret").exists():
        pub, sec = zmq.auth.create_certificates(d, "master")
        written += [Path(pub), Path(sec)]
    if client:
        if not NAME.fullmatch(client) or not valid_tenant(tenant):
            raise ValueError("client name must be 1-128 of [A-Za-z0-9_.-]; tenant 1-128 "
                             "printable characters, no quote, no space at either end")
        cdir = d / "clients"
        cdir.mkdir(exist_ok=True)
        if (cdir / f"{client}.key").exists():
            raise FileExistsError(f"client key {client} already exists in {cdir}")
        old_umask = os.umask(0o077)  # the secret file is never readable by others
        try:
            pub, sec = zmq.auth.create_certificates(cdir, client, metadata={"tenant": tenant})
        finally:
            os.umask(old_umask)
        # The master reads only public certificates: bind the tenant there too.
        text = Path(pub).read_text()
        Path(pub).write_text(text.replace("metadata\n", f'metadata\n    tenant = "{tenant}"\n', 1))
        os.chmod(pub, 0o644)
        written += [Path(pub), Path(sec)]
    for p in written:
        if p.name.endswith("_secret"):
            os.chmod(p, 0o600)
    return written


def master_keys(directory: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) of the master."""
    pub, sec = zmq.auth.load_certificate(Path(directory) / "master.key_secret")
    assert sec is not None
    return pub, sec


def client_keys(directory: str | os.PathLike, client: str) -> tuple[bytes, bytes, bytes]:
    """(client public, client secret, master public) for a client."""
    d = Path(directory)
    pub, sec = zmq.auth.load_certificate(d / "clients" / f"{client}.key_secret")
    if sec is None:
        raise ValueError(f"no secret key in {d / 'clients' / (client + '.key_secret')}")
    server_pub, _ = zmq.auth.load_certificate(d / "master.key")
    return pub, sec, server_pub


def allowed_tenants(directory: str | os.PathLike) -> dict[str, str]:
    """z85 public key (the ZAP User-Id) -> tenant, for every allowed client certificate.

    A certificate without a ``tenant`` metadata entry, or with one that is not a
    valid name (``" default"``), maps to "" and its client is refused at HELLO
    (never silently put in a default or the admin tenant)."""
    out: dict[str, str] = {}
    cdir = Path(directory) / "clients"
    for path in sorted(cdir.glob("*.key")):
        text = path.read_text()
        m = _TENANT.search(text)
        pub, _ = zmq.auth.load_certificate(path)
        tenant = m.group(1) if m else ""
        out[pub.decode()] = tenant if valid_tenant(tenant) else ""
    return out
