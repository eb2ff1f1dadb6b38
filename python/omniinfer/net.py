"""Network address helpers shared by the launcher defaults and the router."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a name or an address, IPv6 zone and brackets allowed, IPv4-mapped IPv6
    included) is this machine's loopback; False for an empty or unparsable host, so an unknown
    peer is never trusted by default."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4's loopback
    return (mapped or address).is_loopback
