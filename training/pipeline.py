"""odma-train's work: split → embed → fit heads → export ONNX → calibrate → evaluate → report."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from odma.config import default_cache_dir
from odma.errors import PredictorError
from predictor.base import Calibration, Manifest, PredictRequest, Predictor
from predictor.registry import load_predictor
from predictor.calibration import calibrate
from predictor.features import MetadataEncoder
from training import data
from training.metrics import evaluate_records, ranking_bound


@dataclass(frozen=True)
class TrainOptions:
    trace: str
    out: Path
    model: str = "encoder"  # "encoder" | "sklearn" | "probe"
    backbone: str = "minilm"
    layers: int | None = 3
    max_len: int = 64
    quantize: bool = True
    target: float = 0.02
    table_groups: int = 10  # L̂ groups of the reservation table calibration may choose; 0: α, τ, ceiling only
    max_new_tokens: int = data.DEFAULT_MAX_NEW_TOKENS
    limit: int | None = None
    s3_baseline: bool = True
    threads: int = 2
    seed: int = 0
    finetune_layers: int = 0  # 0: frozen encoder; N: also train its top N layers (see training/finetune.py)
    finetune_epochs: int = 3
    progress: bool = True
    latency_requests: int = 200
    probe_layer: int | None = None  # --model probe: the served model's layer (None: chosen on a train holdout)
    served_model: str = "smollm2"  # --model probe: whose hidden states
    refine_every: int = 16  # --model probe: decode steps between refinements (what the engine is told)
    refine: bool = True  # --model probe: fit the decode-time head (teacher-forces every training answer: slow)


def _log(opts: TrainOptions, msg: str) -> None:
    if opts.progress:
        print(f"[odma-train] {msg}", flush=True)


def train(opts: TrainOptions) -> dict:
    import torch

    torch.set_num_threads(opts.threads)
    t_start = time.time()
    trace = data.load_for_training(opts.trace, opts.limit)
    cap = data.length_cap(trace, opts.max_new_tokens)
    train_t, val_t, test_t = data.splits(trace)
    y_train, y_val, y_test = (data.capped_lengths(t, cap) for t in (train_t, val_t, test_t))
    stats = data.TrainStats.from_lengths(y_train, cap, opts.target)
    _log(opts, f"{trace.name}: train {len(train_t)}, calibration {len(val_t)}, test {len(test_t)}; cap {cap}; "
               f"buckets {list(stats.bounds)}")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    s3_test_buckets = None
    if opts.model == "encoder":
        predictor, export_check, s3_test_buckets = _train_encoder(opts, trace, train_t, val_t, test_t, y_train,
                                                                  stats, out)
    elif opts.model in ("sklearn", "probe"):
        if opts.model == "sklearn":
            predictor = _train_sklearn(opts, train_t, y_train, stats, out)
        else:
            from training.probe import ProbeOptions, train_probe

            predictor = train_probe(ProbeOptions(served_model=opts.served_model, layer=opts.probe_layer,
                                                 refine_every=opts.refine_every, refine=opts.refine, seed=opts.seed),
                                    trace, train_t, val_t, y_train, stats, out, opts.progress,
                                    lambda msg: _log(opts, msg))
        export_check = None
        if opts.s3_baseline:
            s3_test_buckets = _s3_baseline_only(opts, train_t, test_t, y_train, stats)
    else:
        raise PredictorError(f"unknown model {opts.model!r}: use encoder, sklearn or probe")

    # Calibrate what is served (the exported predictor), on the held-out calibration split.
    val_pred = predictor.predict(val_t.records)
    point = calibrate(np.array([p.length for p in val_pred]), np.array([p.uncertainty for p in val_pred]),
                      y_val, stats.bounds, cap, target=opts.target, table_groups=opts.table_groups)
    calibration = Calibration(stats.bounds, cap, 16, point.alpha, point.tau, opts.target, point.ceiling, point.table)
    chosen = (f"table {list(point.table.tokens)}" if point.table is not None
              else f"alpha={point.alpha:.3f} tau={point.tau:.3f} ceiling={point.ceiling:.0f}")
    _log(opts, f"calibrated {chosen} "
               f"(calibration split: under-prediction {point.underprediction_rate:.3f}, "
               f"over-reservation {point.overreservation:.2f})")
    predictor.calibration = calibration
    test_pred = predictor.predict(test_t.records)
    report = evaluate_records(test_t.records, test_pred, y_test, calibration, stats, s3_test_buckets)
    report["ranking_bound"] = ranking_bound([p.length for p in val_pred], y_val, [p.length for p in test_pred], y_test,
                                            opts.target, cap)
    if opts.model == "probe":
        report.update(_probe_extras(predictor, test_t.records, test_pred, data.capped_lengths(train_t, cap), cap,
                                    opts.progress))
        lat = {}
    else:
        from predictor.latency import measure

        lat = measure(predictor, test_t.records, n_single=opts.latency_requests)
    report.update(_common_fields(opts, trace, stats, predictor))
    report.update({
        "onnx_p50_ms_batch1": lat["p50_ms_batch1"] if opts.model == "encoder" else None,
        "onnx_throughput_rps": lat["throughput_rps"] if opts.model == "encoder" else None,
        "latency": lat or None,
        "n_train": len(train_t), "n_calibration": len(val_t), "n_test": len(test_t),
        "calibration_split": {"underprediction_rate": round(point.underprediction_rate, 4),
                              "mean_overreservation": round(point.overreservation, 4)},
        "train_seconds": round(time.time() - t_start, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),  # the CPU is shared: latency depends on it
    })
    if export_check is not None:
        report["onnx_vs_torch"] = export_check
    manifest = Manifest.load(out)
    manifest.calibration = calibration
    manifest.report = {k: report[k] for k in ("bucket_accuracy", "mae_tokens", "spearman", "underprediction_rate",
                                                "mean_overreservation", "n_test")}
    manifest.save(out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(opts, f"wrote {out / 'report.json'} in {report['train_seconds']} s")
    return report


def _common_fields(opts, trace, stats: data.TrainStats, predictor: Predictor) -> dict:
    manifest = getattr(predictor, "manifest", None)
    settings = manifest.settings if manifest else {}
    return {
        "trace": trace.name,
        "model": opts.model if opts else settings.get("model"),
        "tokenizer": trace.tokenizer,  # the one that counted the lengths
        "backbone": settings.get("backbone_name", settings.get("backbone")),
        "encoder_layers": settings.get("layers"),
        "max_len": settings.get("max_len"),
        "quantized": settings.get("quantize"),
        "median_length_train": stats.median_length,
    }


# -- encoder ----------------------------------------------------------------------------------------


def embedder(opts: TrainOptions):
    """(backbone folder, tokenizer, frozen mean-pooled encoder, embedding cache) for `opts`' backbone."""
    from transformers import AutoTokenizer

    from predictor.embedding_cache import EmbeddingCache, encoder_key
    from predictor.encoder import MeanPooledEncoder, load_backbone, resolve_backbone

    folder = resolve_backbone(opts.backbone)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    encoder = MeanPooledEncoder(load_backbone(opts.backbone, opts.layers))
    cache = EmbeddingCache(default_cache_dir(), encoder_key(folder, opts.layers, opts.max_len))
    return folder, tokenizer, encoder, cache


def embed(opts, tokenizer, encoder, cache, records) -> np.ndarray:
    """The frozen encoder's embeddings of the records' prompts (read from and written to `cache`)."""
    from predictor.embedding_cache import embed_texts

    return embed_texts(encoder, tokenizer, [r.prompt for r in records], opts.max_len, cache, progress=opts.progress)


def _train_encoder(opts, trace, train_t, val_t, test_t, y_train, stats, out: Path):
    from safetensors.torch import save_file

    from predictor.build import probe_outputs
    from predictor.encoder import LengthModel
    from predictor.onnx_export import compare_with_torch, export_onnx
    from predictor.onnx_runtime import HEADS_FILE, ONNX_FILE, TOKENIZER_DIR, OnnxPredictor
    from predictor.text import encode_texts
    from training.heads import HeadTraining, fit_heads

    folder, tokenizer, encoder, cache = embedder(opts)
    emb_train = embed(opts, tokenizer, encoder, cache, train_t.records)
    metadata = MetadataEncoder.fit(train_t.records)
    meta_train = metadata.encode(train_t.records)
    n_buckets = len(stats.bounds)
    labels = np.minimum(data.bucket_index(y_train, stats.bounds), n_buckets - 1)
    cfg = HeadTraining(seed=opts.seed)
    heads = fit_heads(emb_train, meta_train, y_train, labels, n_buckets, cfg, progress=opts.progress)
    s3_test_buckets = None
    s3_heads = None
    if opts.s3_baseline:
        s3_heads, s3_test_buckets = _fit_s3(opts, tokenizer, encoder, cache, emb_train, y_train, test_t, stats)
    tuned_layers = None
    if opts.finetune_layers:
        from training.finetune import TUNED_FILE, FineTuning, fine_tune, tuned_state

        # After the S3 baseline and the cached embeddings: those must stay the frozen encoder's.
        model = fine_tune(encoder, heads, tokenizer, [r.prompt for r in train_t.records], meta_train, y_train,
                          labels, opts.max_len, FineTuning(layers=opts.finetune_layers, epochs=opts.finetune_epochs,
                                                           seed=opts.seed), progress=opts.progress)
        tuned_layers = tuned_state(encoder, opts.finetune_layers)
        save_file(tuned_layers, str(out / TUNED_FILE))
    model = LengthModel(encoder, heads).eval()

    # the probe is what build.py replays on a rebuilt graph: text and prompt length only, no other metadata
    probe_records = [PredictRequest(prompt=r.prompt, prompt_tokens=r.prompt_tokens) for r in val_t.records[:8]]
    settings = {
        "model": "encoder", "backbone": opts.backbone, "backbone_name": folder.name if opts.backbone != "minilm"
        else "all-MiniLM-L6-v2", "layers": opts.layers, "max_len": opts.max_len, "quantize": opts.quantize,
        "metadata": metadata.to_json(), "meta_dim": metadata.size, "n_buckets": n_buckets,
        "embed_dim": encoder.hidden, "head_hidden": cfg.hidden, "head_meta_skip": cfg.meta_skip,
        "train_stats": stats.to_json(),
        "trace": trace.name, "length_target": "log(1 + output tokens), L1 (conditional median)",
        "n_train": len(train_t), "tuned_layers": opts.finetune_layers or None,
    }
    Manifest("encoder", None, settings).save(out)
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(out / HEADS_FILE))
    if s3_heads is not None:
        save_file({k: v.contiguous() for k, v in s3_heads.state_dict().items()}, str(out / "s3_heads.safetensors"))
    for f in out.glob("*.safetensors"):
        f.chmod(0o644)
    tokenizer.save_pretrained(str(out / TOKENIZER_DIR))

    def feed(records) -> dict:
        enc = encode_texts(tokenizer, [r.prompt for r in records], opts.max_len)
        return {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "meta": metadata.encode(records)}

    check_batches = [feed(val_t.records[s : s + 32]) for s in range(0, min(len(val_t), 256), 32)]
    _log(opts, "exporting predictor.onnx")
    fp32_path = out / "predictor.fp32.onnx"
    export_onnx(model, fp32_path, check_batches[0], quantize=False)
    fp32_check = compare_with_torch(model, fp32_path, check_batches)
    check = {"fp32": asdict(fp32_check), "checked_requests": sum(len(b["meta"]) for b in check_batches)}
    if opts.quantize:
        export_onnx(model, out / ONNX_FILE, check_batches[0], quantize=True)
        check["int8"] = asdict(compare_with_torch(model, out / ONNX_FILE, check_batches))
        fp32_path.unlink()
    else:
        fp32_path.replace(out / ONNX_FILE)
    _log(opts, f"ONNX vs torch: {check}")
    predictor = OnnxPredictor(out, threads=opts.threads)
    probe = predictor.run_batch(probe_records)
    probe_fp32 = probe_outputs(model, feed(probe_records))  # what a rebuild checks its backbone against
    settings["probe"] = {"prompts": [r.prompt for r in probe_records],
                         "prompt_tokens": [r.prompt_tokens for r in probe_records],
                         "length": [float(x) for x in probe[0]], "uncertainty": [float(x) for x in probe[1]],
                         "fp32_length": [float(x) for x in probe_fp32[0]],
                         "fp32_uncertainty": [float(x) for x in probe_fp32[1]]}
    Manifest("encoder", None, settings).save(out)
    predictor.manifest = Manifest.load(out)
    return predictor, check, s3_test_buckets


def _fit_s3(opts, tokenizer, encoder, cache, emb_train, y_train, test_t, stats):
    """S3's predictor: the same frozen encoder as a plain classifier over static equal-width buckets."""
    from training.heads import HeadTraining, fit_heads, predict_heads

    k = len(stats.s3_bounds)
    labels = np.minimum(data.bucket_index(y_train, stats.s3_bounds), k - 1)
    no_meta = np.zeros((len(emb_train), 0), np.float32)  # S3 reads the prompt only
    heads = fit_heads(emb_train, no_meta, y_train, labels, k, HeadTraining(regression_weight=0.0, seed=opts.seed),
                      progress=opts.progress, desc="training S3 baseline")
    emb_test = embed(opts, tokenizer, encoder, cache, test_t.records)
    _, probs = predict_heads(heads, emb_test, np.zeros((len(emb_test), 0), np.float32))
    return heads, probs.argmax(1)


def _s3_baseline_only(opts, train_t, test_t, y_train, stats):
    folder, tokenizer, encoder, cache = embedder(opts)
    emb_train = embed(opts, tokenizer, encoder, cache, train_t.records)
    _, buckets = _fit_s3(opts, tokenizer, encoder, cache, emb_train, y_train, test_t, stats)
    return buckets


# -- sklearn ----------------------------------------------------------------------------------------


def _train_sklearn(opts, train_t, y_train, stats, out: Path):
    from predictor.sklearn_baseline import SklearnPredictor

    _log(opts, "fitting the scikit-learn baseline")
    predictor = SklearnPredictor.fit(train_t.records, y_train, stats.bounds, seed=opts.seed)
    manifest = Manifest("sklearn", None, {"model": "sklearn", "backbone": None, "train_stats": stats.to_json(),
                                     "n_train": len(train_t)})
    predictor.save(out, manifest)
    predictor.manifest = Manifest.load(out)
    return predictor


# -- evaluation of an existing predictor ----------------------------------------------------------


def evaluate_existing(spec: str, trace_spec: str, split: str = "all", limit: int | None = None,
                      s3_baseline: bool = True, progress: bool = True, threads: int = 2) -> dict:
    """A saved predictor (its α, τ, buckets, training medians) on any trace with realized lengths."""
    import torch

    torch.set_num_threads(threads)
    predictor = load_predictor(spec)
    manifest: Manifest | None = getattr(predictor, "manifest", None)
    if predictor.calibration is None or manifest is None or "train_stats" not in manifest.settings:
        raise PredictorError(f"predictor {spec!r} has no saved calibration and training statistics to evaluate with")
    stats = data.TrainStats.from_json(manifest.settings["train_stats"])
    trace = data.load_for_training(trace_spec, limit)
    records = trace.records if split == "all" else getattr(data.splits(trace), split).records
    if not records:
        raise PredictorError(f"the {split} split of {trace_spec!r} is empty")
    y = np.minimum(np.array([r.output_tokens for r in records]), predictor.calibration.large_bound)
    s3 = _saved_s3_buckets(predictor, manifest, records, progress) if s3_baseline else None
    probe = manifest.kind == "probe"
    if probe:  # runs the served model's prefill itself; states cached on disk for later runs
        from predictor.probe.hidden import ServedModelStates

        predictor.attach_model(ServedModelStates.load(manifest.settings.get("served_model", "smollm2"),
                                                      manifest.settings.get("dtype", "float32")), default_cache_dir())
        predictor.prompt_states(records, progress=progress)
    preds = predictor.predict(records)
    report = evaluate_records(records, preds, y, predictor.calibration, stats, s3)
    if probe:
        report.update(_probe_extras(predictor, records, preds, None, stats.cap, progress, stats.median_length))
        lat = {}
    else:
        from predictor.latency import measure

        lat = measure(predictor, records)
    encoder = manifest.kind == "encoder"
    report.update(_common_fields(None, trace, stats, predictor))
    report.update({"model": manifest.kind, "predictor": spec, "split": split,
                   "onnx_p50_ms_batch1": lat["p50_ms_batch1"] if encoder else None,
                   "onnx_throughput_rps": lat["throughput_rps"] if encoder else None, "latency": lat or None,
                   "n_train": manifest.settings.get("n_train"), "n_test": len(records)})
    return report


def _probe_extras(predictor, records, preds, train_lengths, cap: int, progress: bool,
                  median_length: float | None = None) -> dict:
    """The probe's decode-time report (remaining-length MAE by generated tokens) and its cost against the
    prefill it rides on."""
    from predictor.probe.cost import probe_cost
    from training.probe import refine_report

    if train_lengths is None:  # eval-only: the median baseline from the saved training median
        train_lengths = np.full(1, median_length or 1.0)
    lengths = np.array([p.length for p in preds])
    return {"refine": refine_report(predictor, records, lengths, train_lengths, cap, progress),
            "probe_cost": probe_cost(predictor, predictor._states, records)}


def _saved_s3_buckets(predictor, manifest: Manifest, records, progress: bool):
    folder = getattr(predictor, "folder", None)
    if folder is None or not (Path(folder) / "s3_heads.safetensors").exists():
        return None
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from predictor.embedding_cache import EmbeddingCache, embed_texts, encoder_key
    from predictor.encoder import LengthHeads, MeanPooledEncoder, load_backbone, resolve_backbone
    from training.heads import predict_heads

    s = manifest.settings
    backbone = resolve_backbone(s["backbone"])
    encoder = MeanPooledEncoder(load_backbone(s["backbone"], s.get("layers")))
    cache = EmbeddingCache(default_cache_dir(), encoder_key(backbone, s.get("layers"), int(s["max_len"])))
    emb = embed_texts(encoder, AutoTokenizer.from_pretrained(str(backbone)), [r.prompt for r in records],
                      int(s["max_len"]), cache, progress=progress)
    k = len(s["train_stats"]["s3_bounds"])
    heads = LengthHeads(encoder.hidden, 0, k, hidden=int(s.get("head_hidden", 256)))
    try:
        heads.load_state_dict(load_file(str(Path(folder) / "s3_heads.safetensors")))
    except Exception as exc:
        raise PredictorError(f"corrupt S3 baseline heads in {folder}: {exc}") from None
    _, probs = predict_heads(heads.eval(), emb, np.zeros((len(emb), 0), np.float32))
    return probs.argmax(1)
