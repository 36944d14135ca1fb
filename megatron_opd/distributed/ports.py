"""Free TCP ports for the servers a run starts itself (a vLLM engine's sync group, test servers)."""

from __future__ import annotations

import random
import socket

_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_free_port() -> int:
    """A free TCP port on the loopback interface, below the kernel's ephemeral range.

    A port the OS hands out for ``bind(0)`` comes from the ephemeral range, which every outgoing connection and
    every other ``bind(0)`` (gloo, ZeroMQ, vLLM's own sockets) draws from too: a server that binds it seconds later
    can find it taken. Ports below that range are only ever taken by an explicit bind, so a random free one stays
    free until our server binds it (never the same one twice in this process)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 20000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded machine: the OS's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
