"""Which addresses a server may bind: the rule the run applies to Ray's dashboard and the Pareto
page applies to itself (a non-loopback address needs an explicit flag).

Shared by every layer of ``search``; imports nothing of it.
"""

from __future__ import annotations

import ipaddress
import socket

from trainers.errors import ConfigError

__all__ = ["is_loopback_host", "check_bind_host"]


def is_loopback_host(host: str) -> bool:
    """True when every address ``host`` names is a loopback address (127.0.0.0/8, ::1)."""
    name = host.strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False  # unresolvable: not provably loopback; binding will report the error
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_bind_host(host: str, *, allow_remote: bool, flag: str, option: str, what: str) -> None:
    """Refuse a non-loopback ``host`` unless ``allow_remote``: one line that names the flag."""
    if allow_remote or is_loopback_host(host):
        return
    raise ConfigError(
        f"{option} {host}: not a loopback address, so anyone who can reach this machine could open {what}; "
        f"pass {flag} to bind it anyway, or keep 127.0.0.1 and tunnel (ssh -L PORT:127.0.0.1:PORT HOST)"
    )
