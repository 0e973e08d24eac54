"""Replay a trace through the online length predictor (predictor/online.py), one completion at a time.

Each request, in a shuffled order, is predicted by whatever the online predictor serves at that moment (the
shipped predictor until `--min-samples` completions, then the online probe), reserved through the current
calibration's bucket manager (what `select` gives the allocator), and then observed with its realized length.
Features are the served model's (SmolLM2's) prompt-end states at the probe's layer, from odma's own prefill
(cached on disk). Reported: under-prediction and over-reservation on the first `--warmup` completions and on
the rest, against the same stream served by the shipped predictor alone, for each refit period N.

    .venv/bin/python scripts/studies/online_replay.py --trace alpaca-eval:llama-2-7b-chat-hf --shipped probe \
        --refit-every 16,32,64,128,256 --json runs/online_llama2_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np


def replay(online_probe, states: np.ndarray, requests: list, lengths: np.ndarray, warmup: int) -> dict:
    missed, reserved, sources = [], [], []
    manager, manager_of = None, None
    for row, req, y in zip(states, requests, lengths):
        pred = online_probe.predict(row[None, :], [req])[0]
        cal = online_probe.calibration
        if cal is not manager_of:
            manager, manager_of = cal.bucket_manager(), cal
        bound = manager.select(pred.length, pred.uncertainty).bound
        missed.append(y > bound)
        reserved.append(bound)
        sources.append(online_probe.source)
        online_probe.observe(row, req, int(y))
    missed, reserved = np.array(missed), np.array(reserved, dtype=float)
    out = {}
    for name, part in (("first", slice(0, warmup)), ("rest", slice(warmup, None))):
        y = lengths[part]
        out[name] = {"n": int(len(y)), "underprediction_rate": round(float(missed[part].mean()), 4),
                     "mean_overreservation": round(float(reserved[part].sum() / max(y.sum(), 1)), 4),
                     "online_share": round(float(np.mean(np.array(sources[part]) == "online")), 4)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--shipped", default="probe", help="'probe' (SmolLM2's committed probe) or any predictor spec")
    p.add_argument("--probe", default="probe", help="whose layer and metadata the online head uses")
    p.add_argument("--refit-every", default="64")
    p.add_argument("--min-samples", type=int, default=256)
    p.add_argument("--warmup", type=int, default=256)
    p.add_argument("--target", type=float, default=0.02)
    p.add_argument("--large-bound", type=int, default=2048)
    p.add_argument("--seeds", default="0", help="stream orders to average over")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    import torch

    from odma.config import default_cache_dir
    from odma.traces import load_trace
    from predictor import load_predictor
    from predictor.online import OnlineConfig, OnlineProbe
    from predictor.probe.hidden import ServedModelStates
    from predictor.probe.identity import model_identity
    from predictor.probe.state_cache import StateCache, prompt_states

    torch.set_num_threads(args.threads)
    probe = load_predictor(args.probe)
    shipped = probe if args.shipped == args.probe else load_predictor(args.shipped)
    states_model = ServedModelStates.load(probe.settings.get("served_model", "smollm2"))
    identity = model_identity(states_model.model)
    trace = load_trace(args.trace)
    records = [r for r in trace.records if r.prompt]
    lengths = np.minimum([r.output_tokens for r in records], args.large_bound)
    all_states = prompt_states(states_model, [r.prompt for r in records], StateCache(default_cache_dir(), identity),
                               progress=True)[:, probe.layer]
    # what the engine passes the predictor: prompt text and length, temperature, the served model's name
    requests = [SimpleNamespace(prompt=r.prompt, prompt_tokens=r.prompt_tokens, temperature=0.7,
                                generator="SmolLM2-135M-Instruct") for r in records]
    report = {"trace": args.trace, "n": len(records), "shipped": args.shipped, "target": args.target,
              "warmup": args.warmup, "min_samples": args.min_samples, "layer": probe.layer,
              "realized_p50": float(np.median(lengths)), "runs": {}}
    seeds = [int(s) for s in args.seeds.split(",")]
    for n in [int(v) for v in args.refit_every.split(",")]:
        runs = []
        for seed in seeds:
            order = np.random.default_rng(seed).permutation(len(records))
            config = OnlineConfig(refit_every=n, min_samples=args.min_samples, target=args.target,
                                  large_bound=args.large_bound, background=False)
            online = OnlineProbe(identity, states_model.hidden_size, probe.layer, shipped,
                                 metadata=probe.metadata, config=config, state_dir=None)
            started = time.perf_counter()
            result = replay(online, all_states[order], [requests[i] for i in order], lengths[order], args.warmup)
            result["seconds"] = round(time.perf_counter() - started, 2)
            result["refits"] = online.stats()["refits"]
            runs.append(result)
        report["runs"][str(n)] = {
            "per_seed": runs,
            "rest_underprediction_mean": round(float(np.mean([r["rest"]["underprediction_rate"] for r in runs])), 4),
            "rest_overreservation_mean": round(float(np.mean([r["rest"]["mean_overreservation"] for r in runs])), 4),
            "refit_seconds_mean": round(float(np.mean([r["seconds"] for r in runs])), 2),
        }
        print(json.dumps({n: {k: v for k, v in report["runs"][str(n)].items() if k != "per_seed"}}), flush=True)
    # the same streams served by the shipped predictor alone (never adapting)
    base = []
    for seed in seeds:
        order = np.random.default_rng(seed).permutation(len(records))
        preds = shipped.predict_features(all_states[order], [requests[i] for i in order]) \
            if hasattr(shipped, "predict_features") else shipped.predict([requests[i] for i in order])
        manager = shipped.calibration.bucket_manager()
        bound = np.array([manager.select(float(a), float(b)).bound for a, b in preds], dtype=float)
        y = lengths[order]
        base.append({"rest_underprediction": round(float(np.mean(y[args.warmup:] > bound[args.warmup:])), 4),
                     "rest_overreservation": round(float(bound[args.warmup:].sum() / y[args.warmup:].sum()), 4)})
    report["shipped_only"] = base
    print(json.dumps({"shipped_only": base}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
