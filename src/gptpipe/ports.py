"""A local TCP port that is free right now: a process group's MASTER_PORT when no launcher set one, and the
servers tests and benchmarks start (storage emulators)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the system just handed out; concurrent runs that each ask get different ones."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
