"""How far the served weights' int8 activations move the model's next-token distribution, beside a 32-depth scheme.

The default CPU path multiplies SmolLM2's Q4_1 blocks with activations quantized to int8 per row and 16 depths
(backends/cpu_quant.py). For Alpaca prompts (SmolLM2's chat template, the distribution after the prompt) this
measures KL(fp32 activations || each of): odma's kernel with int8 activations; the same file dequantized to fp32 with
every linear layer's input rounded per 16 depths (what the kernel computes, emulated); and per 32 depths (the block
size of ggml's Q8_0 / Q8_1 activations, emulated here in torch: a comparison of schemes, not a llama.cpp run), with
top-1 agreement.

    .venv/bin/python scripts/studies/int8_activations_kl.py --prompts 40 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from backends import cpu_quant  # noqa: E402
from odma.config import default_data_dir  # noqa: E402
from odma.models.llama import SeqSlot  # noqa: E402
from odma.models.weights import load_served_model  # noqa: E402


def last_logits(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    kv = torch.zeros(c.num_layers, 2, len(ids) + 1, c.num_kv_heads, c.head_dim)
    with torch.no_grad():
        return model(torch.tensor(ids), torch.arange(len(ids)), [SeqSlot(kv, 0, len(ids))]).float()[0]


def rounded_inputs(block: int):
    """A forward pre-hook rounding a linear layer's input to int8 per row and `block` depths (max|x| / 127, nearest)."""
    def hook(_module, args):
        x = args[0]
        b = x.float().reshape(-1, x.shape[-1] // block, block)
        d = b.abs().amax(-1, keepdim=True) / 127
        safe = torch.where(d > 0, d, torch.ones_like(d))
        return ((torch.round(b / safe) * d).reshape(x.shape).to(x.dtype),)
    return hook


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = F.log_softmax(p_logits, -1), F.log_softmax(q_logits, -1)
    return float((p.exp() * (p - q)).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the per-prompt values here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    native, folder, _ = load_served_model("smollm2", weights="native")
    dense, _, _ = load_served_model("smollm2", weights="f32")
    tok = AutoTokenizer.from_pretrained(str(folder))
    records = json.loads((default_data_dir() / "alpaca" / "alpaca_en_demo.json").read_text())[: args.prompts]
    kernel = cpu_quant.load()
    before = kernel.activations
    linears = [m for n, m in dense.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n]
    out: dict = {"kernel_int8": [], "emulated_per16": [], "emulated_per32": []}
    agree = dict.fromkeys(out, 0)
    try:
        for r in records:
            text = r["instruction"] + ("\n" + r["input"] if r.get("input") else "")
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[: args.max_prompt]
            kernel.activations = "f32"
            ref = last_logits(native, ids)
            kernel.activations = "int8"
            runs = {"kernel_int8": last_logits(native, ids)}
            for name, block in (("emulated_per16", 16), ("emulated_per32", 32)):
                hooks = [m.register_forward_pre_hook(rounded_inputs(block)) for m in linears]
                try:
                    runs[name] = last_logits(dense, ids)
                finally:
                    for h in hooks:
                        h.remove()
            for name, logits in runs.items():
                out[name].append(kl(ref, logits))
                agree[name] += int(logits.argmax() == ref.argmax())
    finally:
        kernel.activations = before
    summary = {name: {"kl_mean": round(statistics.mean(v), 5), "kl_median": round(statistics.median(v), 5),
                      "kl_max": round(max(v), 4), "top1_agree": f"{agree[name]}/{len(v)}"} for name, v in out.items()}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "kl": out, "prompts": len(records),
                                               "kernel_isa": kernel.isa}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
