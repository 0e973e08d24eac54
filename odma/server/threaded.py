"""Run the app under uvicorn in a background thread (tests, and `odma-bench serve --start-server`)."""

from __future__ import annotations

import random
import socket
import threading
import time

import uvicorn


def free_port(host: str = "127.0.0.1", *, below_ephemeral: bool = False) -> int:
    """A port free now. below_ephemeral: one under the kernel's ephemeral range, for a server that binds it only
    after starting other processes (Ray's proxy): their own sockets take ephemeral ports, and one of them took the
    port chosen for the proxy in a CI run ("Failed to bind to address")."""
    low = _ephemeral_low() if below_ephemeral else 0
    if low <= 2048:  # not asked for, or no room below the range on this system
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    span = min(12000, low - 1024)
    start = random.randrange(span)
    for i in range(span):
        port = low - span + (start + i) % span
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} below {low}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems' ranges start higher


class ThreadedServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        port = port or free_port(host)
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="odma-uvicorn", daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
