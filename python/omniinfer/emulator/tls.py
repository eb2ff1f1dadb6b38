"""HTTPS for the emulated worker, with SGLang's flag names (``--ssl-certfile``, ``--ssl-keyfile``,
``--ssl-ca-certs``). Pure construction: no sockets."""

from __future__ import annotations

import ssl


def tls_context(certfile: str | None, keyfile: str | None, ca_certs: str | None
                ) -> ssl.SSLContext | None:
    """HTTPS as SGLang's ``--ssl-certfile``/``--ssl-keyfile``/``--ssl-ca-certs`` ask for it, or
    None. With ``ca_certs`` the emulator *requires* a client certificate signed by one of them
    (mutual TLS), stricter than SGLang's default, so tests can see a client without one refused.
    ValueError names the flag of a file that cannot be loaded."""
    if bool(certfile) != bool(keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    if not certfile or not keyfile:
        if ca_certs:
            raise ValueError("--ssl-ca-certs has no effect without --ssl-certfile and --ssl-keyfile")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load them ({exc})") from None
    if ca_certs:
        try:
            context.load_verify_locations(cafile=ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-ca-certs: cannot load it ({exc})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context
