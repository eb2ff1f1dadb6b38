"""TLS for the router's clients and its workers, as sglang-router's flags ask for it.

- ``--tls-cert-path`` / ``--tls-key-path``: the router serves HTTPS on its main port (the
  ``/metrics`` listener stays plain HTTP, as the peers keep it).
- ``--ca-cert-paths``: CA certificates (PEM) that workers' certificates are checked against, on
  top of the system's; without them only the system's CAs are trusted. Workers are reached over
  TLS when their URL is ``https://``; the certificate must name the host of that URL.
- ``--client-cert-path`` / ``--client-key-path``: the certificate the router presents to
  ``https://`` workers that ask for one (mutual TLS).

Every file is read at start-up; a missing or unreadable one is a usage error naming the flag,
never a failure on the first request. Pure construction: no sockets here.

Known limit: asyncio hands a TLS connection to the listener's guards only once its handshake
is done, so connections still in their handshake (each bounded by ``TLS_HANDSHAKE_TIMEOUT_S``,
10 s) do not count against ``--max-connections``; facing an untrusted network, terminate TLS in
a load balancer with connection limits, or bound connections per client in the network.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence


def _need_pair(cert: str | None, key: str | None, cert_flag: str, key_flag: str) -> None:
    if bool(cert) != bool(key):
        given, missing = (cert_flag, key_flag) if cert else (key_flag, cert_flag)
        raise ValueError(f"{given} needs {missing} as well")


def server_context(cert_path: str | None, key_path: str | None) -> ssl.SSLContext | None:
    """The context the router's main listener serves with, or None for plain HTTP."""
    _need_pair(cert_path, key_path, "--tls-cert-path", "--tls-key-path")
    if not cert_path or not key_path:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-cert-path / --tls-key-path: cannot load the certificate and "
                         f"key ({exc.strerror if isinstance(exc, OSError) and exc.strerror else exc})"
                         ) from None
    return context


def worker_context(ca_paths: Sequence[str], client_cert: str | None,
                   client_key: str | None) -> ssl.SSLContext:
    """The context for ``https://`` workers: the system's CAs plus ``ca_paths``, hostnames
    checked, and the router's client certificate when one is given."""
    _need_pair(client_cert, client_key, "--client-cert-path", "--client-key-path")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for path in ca_paths:
        try:
            context.load_verify_locations(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ca-cert-paths {path}: cannot load it as PEM CA certificates "
                             f"({exc})") from None
    if client_cert and client_key:
        try:
            context.load_cert_chain(client_cert, client_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--client-cert-path / --client-key-path: cannot load the "
                             f"certificate and key ({exc})") from None
    return context
