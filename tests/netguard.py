"""Refuse every network connection outside loopback, and record the attempts.

Installed for the whole test session by conftest.py; a CLI subprocess installs it with
`python -c "import tests.netguard as g; g.install(); ..."`, appending attempts to $NETGUARD_LOG.
Users run this tool on air-gapped machines: a default run must not even try to reach the internet.
"""

from __future__ import annotations

import ipaddress
import os
import socket


class NetworkAccessError(RuntimeError):
    pass


def _is_loopback(address) -> bool:
    if not isinstance(address, tuple):
        return isinstance(address, str | bytes)  # an AF_UNIX path is local
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo
attempted_connections: list[object] = []


def _guarded_connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
        _record(address)
        raise NetworkAccessError(f"test tried to connect to {address}: only loopback is allowed")
    return _real_connect(self, address)


def _guarded_connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
        _record(address)
        raise NetworkAccessError(f"test tried to connect to {address}: only loopback is allowed")
    return _real_connect_ex(self, address)


def _guarded_getaddrinfo(host, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name is not None and not _is_loopback((name,)) and name not in ("127.0.0.1", "::1"):
        try:
            ipaddress.ip_address(name)
        except ValueError:
            _record(name)
            raise NetworkAccessError(f"test tried to resolve {name}: only loopback is allowed") from None
    return _real_getaddrinfo(host, *args, **kwargs)


def _record(target: object) -> None:
    attempted_connections.append(target)
    log = os.environ.get("NETGUARD_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(f"{target}\n")


def install() -> None:
    socket.socket.connect = _guarded_connect
    socket.socket.connect_ex = _guarded_connect_ex
    socket.getaddrinfo = _guarded_getaddrinfo
