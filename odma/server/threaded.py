"""Run the app under uvicorn in a background thread (tests, and `odma-bench serve --start-server`)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
