"""How long odma-serve takes to stop on Ctrl-C: it starts the server, optionally sends --warm requests and opens
--streams chat streams of 2,000 tokens, sends SIGINT and times the process's exit (reaped at once), and shows how
each stream ended.

    .venv/bin/python scripts/shutdown_probe.py --streams 2 -- .venv/bin/odma-serve --length-log ''

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import threading
import time

import httpx

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Give three tips for staying healthy."}]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8123, help="port the server is started on (default: %(default)s)")
    p.add_argument("--warm", type=int, default=0, help="requests served before the test (default: %(default)s)")
    p.add_argument("--streams", type=int, default=0, help="streams in flight at SIGINT (default: %(default)s)")
    p.add_argument("command", nargs="+", help="the server command, without --port")
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([*args.command, "--port", str(args.port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    while True:
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.5)
    for _ in range(args.warm):
        httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 96}, timeout=120)
    ends: list[tuple[float, list[str]]] = []

    def stream() -> None:
        last: list[str] = []
        body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = (last + [line[:120]])[-2:]
        ends.append((time.monotonic(), last))

    threads = [threading.Thread(target=stream) for _ in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(3 if args.streams else 0.5)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    exited = time.monotonic() - start
    for t in threads:
        t.join()
    print(json.dumps({"streams": args.streams, "warm": args.warm, "exit_s": round(exited, 2), "rc": proc.returncode,
                      "stream_ends_s": [round(at - start, 2) for at, _ in ends],
                      "last_events": [last for _, last in ends][:1]}))


if __name__ == "__main__":
    main()
