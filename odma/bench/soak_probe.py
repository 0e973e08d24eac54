"""What `odma-bench soak` samples every few seconds: a server's processes (from /proc), its gauges (from /metrics)
and the machine's load average. Linux only (/proc)."""

from __future__ import annotations

import os
import re
from pathlib import Path

# gauges that must read 0 when no request is in flight, by server: (name in the sample, Prometheus name)
ODMA_GAUGES = (("queue_depth", "odma_queue_depth"), ("running", "odma_running_requests"),
               ("kv_reserved_bytes", "odma_kv_reserved_bytes"), ("kv_live_bytes", "odma_kv_live_bytes"),
               ("device_waiting", "odma_device_waiting_requests"))
VLLM_GAUGES = (("queue_depth", "vllm:num_requests_waiting"), ("running", "vllm:num_requests_running"),
               ("kv_usage", "vllm:kv_cache_usage_perc"))


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (Ray's GCS, raylet and workers under odma-serve --ray; vLLM's engine core)."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_status(int(entry)).get("PPid", "0"))
            except (OSError, ValueError):
                continue
            by_parent.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in by_parent.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def process(pid: int) -> dict | None:
    """RSS (MB), open file descriptors and threads of one process; None once it is gone."""
    try:
        s = _status(pid)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    return {"rss_mb": int(s.get("VmRSS", "0 kB").split()[0]) / 1024, "fds": fds, "threads": int(s.get("Threads", 0))}


def process_tree(pid: int) -> dict:
    """The server process itself and the sum over it and its descendants."""
    own = process(pid) or {"rss_mb": 0.0, "fds": 0, "threads": 0}
    total = dict(own)
    kids = children(pid)
    for c in kids:
        p = process(c)
        if p:
            for k in total:
                total[k] += p[k]
    return {**{k: round(v, 1) for k, v in own.items()},
            **{f"tree_{k}": round(v, 1) for k, v in total.items()}, "processes": 1 + len(kids)}


def matching(pattern: str) -> list[int]:
    """Processes whose command line contains `pattern` (Ray names a replica's worker `ray::ServeReplica:...`)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if pattern in cmd:
                out.append(int(entry))
    return sorted(out)


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def gauges(metrics_text: str, names=ODMA_GAUGES) -> dict:
    """The named gauges from a Prometheus text (labelled series summed: one per device or replica)."""
    out = {}
    for key, name in names:
        values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+|NaN)$", metrics_text, re.M)
        if values:
            out[key] = sum(float(v) for v in values if v != "NaN")
    return out


def listening_pid(port: int) -> int | None:
    """The process holding the listening TCP socket on `port` (IPv4 or IPv6), from /proc/net and each fd's inode."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
                inodes.add(f[9])
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                link = os.readlink(f"/proc/{entry}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(entry)
        except OSError:
            continue
    return None
