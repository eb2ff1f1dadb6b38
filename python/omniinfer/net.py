"""Network address helpers shared by the launcher defaults and the router."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a name or an address, IPv6 zone allowed) is this machine's loopback;
    False for an empty or unparsable host, so an unknown peer is never trusted by default."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
