"""Whether a host is this machine: the one test every loopback rule shares (a server's bind check and Host header,
a client's warning before it sends a token in clear, whether Prefect artifacts stay on this machine)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`localhost`, or an IPv4/IPv6 loopback address (bracketed or not); a host name is not: it may resolve anywhere.

    >>> [is_loopback(h) for h in ("localhost", "127.0.0.2", "[::1]", "::1", "0.0.0.0", "example.org", "")]
    [True, True, True, True, False, False, False]
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False
