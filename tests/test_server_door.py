"""The server sees a protocol, not an object graph: odma/server reaches a runtime and its engine only through
`ServedRuntime` / `ServedEngine` (odma.server.served_engine), both runtimes (in process and the Ray ingress)
implement them, and /metrics is built from the engine's snapshot, which merges over replicas as their metrics do."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

import odma.server
from odma.engine.stats import BucketStats, DeviceStats, EngineStats, PredictorStats, ProbeStats
from odma.server.served_engine import ServedEngine, ServedRuntime

SERVER = Path(odma.server.__file__).parent
# runtime.py is the in-process runtime itself, engine_process.py the engine process's: both drive an LLMEngine (the
# other side of the door)
IMPLEMENTATION = {"runtime.py", "engine_process.py"}
# the modules that build the in-process runtime (an LLMEngine and its AsyncEngine) and hand it to the app
COMPOSITION = {"cli.py", "testing.py"}
ROOTS = {"engine": ServedEngine, "runtime": ServedRuntime}


def _walkable(tp) -> bool:
    """A type whose members a chain may go on to read: the protocols and typed values (configs, snapshots)."""
    return inspect.isclass(tp) and (getattr(tp, "_is_protocol", False) or dataclasses.is_dataclass(tp))


def members(cls) -> dict[str, object]:
    """A protocol's or a typed value's public members, each with its type (None where a chain must stop: methods,
    plain values)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {name: hints.get(name) for name in dir(cls) if not name.startswith("_")}
    out.update({name: tp for name, tp in hints.items() if not name.startswith("_")})
    for name, value in inspect.getmembers(cls):
        if isinstance(value, property):
            out[name] = typing.get_type_hints(value.fget).get("return")
    return {name: tp if _walkable(tp) else None for name, tp in out.items()}


def _chain(node: ast.Attribute) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None  # rooted at a call or a subscript: its own chain starts there
    return [node.id, *reversed(names)]


def door_violations(source: str, filename: str = "<source>") -> list[str]:
    """Each attribute chain through an object named `engine` or `runtime` (a local, a parameter or `x.engine`)
    that reads a member the protocol does not have, or goes on past one that is not itself a protocol or a typed
    value (`runtime.engine.workers`, `engine.scheduler.counters`, `engine.stats().x` is fine)."""
    tree = ast.parse(source, filename)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain = _chain(node)
        if chain is None:
            continue
        start = next((i for i, name in enumerate(chain) if name in ROOTS), None)
        if start is None:
            continue
        tp, path = ROOTS[chain[start]], chain[start]
        for attr in chain[start + 1:]:
            where = f"{filename}:{node.lineno}: {'.'.join(chain)}"
            if tp is None:
                out.append(f"{where}: goes past {path}")
                break
            found = members(tp)
            if attr not in found:
                out.append(f"{where}: {tp.__name__} has no {attr!r}")
                break
            tp, path = found[attr], f"{path}.{attr}"
    return out


def server_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(SERVER.glob("*.py")) if p.name not in IMPLEMENTATION}


def test_the_server_reaches_the_engine_only_through_the_protocol():
    found = [v for name, text in server_sources().items() for v in door_violations(text, name)]
    assert found == []


def test_only_the_composition_names_the_concrete_engine_and_runtime():
    concrete = {"LLMEngine", "AsyncEngine"}
    named = {}
    for name, text in server_sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and concrete & {a.name for a in node.names}:
                named.setdefault(name, set()).update(concrete & {a.name for a in node.names})
    assert set(named) <= COMPOSITION, named


@pytest.mark.parametrize("line", [
    "engine = runtime.engine\nengine.workers",
    "runtime.engine.scheduler.counters",
    "self.runtime.engine.policy",
    "w = engine.pool.stats()",
    "engine.config.pool.align.real",  # past a plain value
    "runtime.waiting.real",
    "engine.probe_fallback",
])
def test_the_door_check_catches_a_reach_into_the_engine(line):
    assert door_violations(line)


@pytest.mark.parametrize("line", [
    "runtime.engine.config.max_tokens_cap", "self.engine.validate(ids, p)", "runtime.stats().devices",
    "s = self.runtime.stats()\ns.devices", "engine.config.pool.align", "srv.runtime.close()", "runtime.engine.eos_ids",
])
def test_the_door_check_lets_the_protocol_through(line):
    assert door_violations(line) == []


def test_the_door_check_finds_what_metrics_read_before_the_snapshot():
    before = '''
def collect(self):
    engine = self.runtime.engine
    per_device = [(w, w.pool.stats(), w.scheduler.counters) for w in engine.workers]
    swaps = [w.swap.controller.logical_bytes for w in engine.workers if w.swap is not None]
    yield engine.forks.copied, engine.predictor, engine.probe
'''
    found = door_violations(before)
    assert len(found) == 5 and all("has no" in v for v in found), found


# -- both runtimes implement the protocol ----------------------------------------------------------------------


def _protocol_members(proto) -> set[str]:
    return {n for n in members(proto)} | set(typing.get_type_hints(proto))


def test_both_runtimes_implement_every_member(tmp_path):
    from odma.server.testing import tiny_model_folder, tiny_server
    from odma.serve_ray.front import ClusterView, FrontEngine, RemoteRuntime
    from odma.serve_ray.settings import RaySettings
    from odma.models.config import ModelConfig

    folder = tiny_model_folder(tmp_path / "tiny")
    with tiny_server(folder) as srv:
        local = srv.runtime
        config = local.engine.config
        assert isinstance(local, ServedRuntime) and isinstance(local.engine, ServedEngine)
        assert local.stats() == EngineStats.from_dict(local.stats().as_dict())
    front = FrontEngine(config, None, ModelConfig.from_folder(folder), ClusterView(config), model_folder=folder)
    engines = SimpleNamespace(options=lambda **_: SimpleNamespace(generate=None))
    remote = RemoteRuntime(front, engines, cluster=None, settings=RaySettings(), predictor=None)
    assert isinstance(remote, ServedRuntime) and isinstance(remote.engine, ServedEngine)
    from odma.server.testing import tiny_process_server

    with tiny_process_server(folder) as srv:
        process = srv.runtime
        assert isinstance(process, ServedRuntime) and isinstance(process.engine, ServedEngine)
        assert process.stats() == EngineStats.from_dict(process.stats().as_dict())
    for proto, objects in ((ServedRuntime, (local, remote, process)), (ServedEngine, (local.engine, front, process.engine))):
        for name in _protocol_members(proto):
            for obj in objects:
                assert hasattr(obj, name), f"{type(obj).__name__} lacks {proto.__name__}.{name}"
                want = getattr(proto, name, None)
                if inspect.isfunction(want):  # a method: the same parameters
                    got = getattr(obj, name)
                    assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters)[1:], \
                        f"{type(obj).__name__}.{name}"
    assert remote.stats() == EngineStats(policy=config.policy)  # no replica reported yet
    remote.drain()
    assert remote.closing


# -- the snapshot and its merge ---------------------------------------------------------------------------------


def _device(name: str, k: int) -> DeviceStats:
    return DeviceStats(
        device=name, running=k, waiting=2 * k, budget_bytes=1 << 20, reserved_bytes=4096 * k, live_bytes=1024 * k,
        free_bytes=(1 << 20) - 4096 * k, external_fragmentation=0.1 * k, live_blocks_per_bucket={0: k, -1: 1},
        pool_counters={"migrations": 3 * k, "migrated_tokens": 50 * k, "migration_refusals": k, "grown_in_place": k,
                       "refusals": 7 * k},
        scheduler_counters={"preemptions": k, "stalls": 2 * k, "swap_outs": k, "swap_ins": k, "theta_refusals": k,
                            "prefix_copies": 5 * k, "prefix_tokens": 80 * k, "activation_refusals": k},
        swap_held_bytes=512 * k, swap_buffer_bytes=1 << 30,
        balloon={"reserve_bytes": 1000, "lent_bytes": 100 * k, "balloon_inflations": k, "balloon_deflations": k,
                 "balloon_deflate_rollbacks": 0, "balloon_moved_bytes": 64 * k})


def _snapshot(k: int) -> EngineStats:
    return EngineStats(
        policy="odma", predictor=PredictorStats("running-median"), devices=(_device("cpu:0", k), _device("cpu:1", k + 1)),
        buckets=BucketStats((96, 208), 512, 3), waiting=k, steps=100 * k, busy_seconds=1.5 * k, decode_tokens=900 * k,
        prefill_tokens=300 * k, prompt_copies=k, prompt_recomputes=0, rejected_predictions=k,
        probe=ProbeStats("online", 10 * k, 20 * k, 0, 0.25 * k, 40 * k, k, {"alpha": 0.5, "tau": 1.0, "ceiling": None,
                                                                          "target": 0.9}))


class _Fixed:
    """A runtime whose snapshot is given (what the collector reads)."""

    def __init__(self, stats: EngineStats) -> None:
        self._stats, self.waiting = stats, 0

    def stats(self) -> EngineStats:
        return self._stats


def _metrics_text(stats: EngineStats) -> str:
    from prometheus_client import generate_latest

    from odma.server.metrics import Metrics

    m = Metrics()
    m.attach(_Fixed(stats))
    return generate_latest(m.registry).decode()


def _values(families) -> dict[tuple, float]:
    out = {}
    for fam in families:
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = dict(s.labels)
            if "replica" in labels:  # merged texts: one series per replica's device
                labels["device"] = f"{labels.pop('replica')}/{labels['device']}"
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_a_merged_snapshot_gives_the_metrics_the_merged_texts_give():
    """The ingress's two views of the cluster agree: /metrics of the replicas' merged snapshots is the merge of
    the replicas' /metrics, series for series."""
    from prometheus_client.parser import text_string_to_metric_families

    from odma.serve_ray.merge_metrics import merge_stats, merge_texts

    replicas = {"r0": _snapshot(1), "r1": _snapshot(2)}
    merged_texts = _values(merge_texts({name: _metrics_text(s) for name, s in replicas.items()}))
    from_stats = _values(text_string_to_metric_families(_metrics_text(merge_stats(replicas, policy="odma"))))
    assert from_stats.keys() == merged_texts.keys()
    for key, value in merged_texts.items():
        assert from_stats[key] == pytest.approx(value), key
    assert from_stats[("odma_kv_reserved_bytes", ())] == 4096 * (1 + 2 + 2 + 3)


def test_the_ingress_runtime_merges_what_the_replicas_reported(tmp_path):
    from odma.engine import EngineConfig
    from odma.serve_ray.cluster import ClusterState
    from odma.serve_ray.front import ClusterView, RemoteRuntime
    from odma.serve_ray.merge_metrics import merge_stats
    from odma.serve_ray.settings import RaySettings

    state = ClusterState(None)
    for name, k in (("r0", 1), ("r1", 2)):
        state.report(name, [], load={}, stats=_snapshot(k).as_dict())
    view = ClusterView(EngineConfig(policy="static"))
    view.apply(state.snapshot())
    engine = SimpleNamespace(view=view, config=view.config)
    remote = RemoteRuntime(engine, SimpleNamespace(options=lambda **_: SimpleNamespace(generate=None)), None,
                           RaySettings(), None)
    assert remote.stats() == merge_stats({"r0": _snapshot(1), "r1": _snapshot(2)}, policy="static")
    state.leave("r1")
    view.apply(state.snapshot())
    assert remote.stats().devices == tuple(dataclasses.replace(d, device=f"r0/{d.device}") for d in _snapshot(1).devices)
