"""int8 activations against fp32 activations on a real model (backends/cpu_quant.py, ODMA_QUANT_ACTIVATIONS), or
with `--compare kv` an fp16 KV cache against an fp32 one: perplexity on held-out text and greedy tokens on
tests/test_model_smollm2.py's prompts.

    .venv/bin/python scripts/int8_accuracy.py [--compare activations|kv] [--model smollm2] [--tokens 4000]

--model: anything EngineConfig takes with native weights (default: SmolLM2-135M-Instruct's Q4_1 GGUF; a .gguf path,
e.g. llama.cpp's Q4_0 file of the same model). Perplexity: AlpacaEval's text-davinci-003 answers (the model never
wrote them), each after its instruction in the chat template, scored on the answer's tokens only, answers taken in
file order until --tokens are scored; the prompts prefilled in one step each, so every row count's path runs in
the mode asked for (`int8`: every row count). Greedy: 32 tokens of each of the 7 prompts, one batch, per mode;
prints the first position where int8's tokens leave fp32's. `--compare kv`: the engine's default activations, the
cache in fp32 and in fp16 (the perplexity's prompts read it through the prefill's attention, the greedy tokens
through the decode kernel). One thread.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

# the greedy-token prompts of tests/test_model_smollm2.py (a script never imports the tests)
PROMPTS = [
    "hi",
    "What is the capital of France?",
    "Write a short poem about the sea, the wind and a lighthouse keeper who cannot sleep at night.",
    "Explain in detail how a refrigerator works, step by step, as if I were ten years old, and mention "
    "the compressor, the condenser, the expansion valve and the evaporator.",
]


def chat_ids(tok, prompt: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False)


def main() -> None:
    from backends import cpu_quant
    from odma.engine import EngineConfig, LLMEngine, SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "datasets"))
    p.add_argument("--compare", default="activations", choices=("activations", "kv"))
    args = p.parse_args()
    torch.set_num_threads(1)

    def engine_with(kv_dtype: str | None = None) -> LLMEngine:
        return LLMEngine(EngineConfig(model=args.model, kv_budget="128MiB", length_log=None, predictor="median",
                                      threads=1, weights="native", max_prefill_tokens=2048, kv_dtype=kv_dtype))

    kernel = cpu_quant.load()
    if args.compare == "kv":
        arms = {"f32": (engine_with("float32"), None), "f16": (engine_with("float16"), None)}
    else:
        engine = engine_with()
        arms = {"f32": (engine, "f32"), "int8": (engine, "int8")}
    tok = next(iter(arms.values()))[0].tokenizer
    rows = json.loads((Path(args.data) / "alpaca_eval" / "text_davinci_003.json").read_text())
    texts, scored = [], 0
    for row in rows:
        head = chat_ids(tok, row["instruction"])
        answer = tok.encode(row["output"].strip() + "<|im_end|>", add_special_tokens=False)
        texts.append((head + answer, len(head)))
        scored += len(answer)
        if scored >= args.tokens:
            break
    prompts = PROMPTS + [p + " Answer in French." for p in PROMPTS[1:]]
    greedy_ids = [chat_ids(tok, p) for p in prompts]
    result = {"model": args.model, "compare": args.compare, "kernel": f"{kernel.isa}, {kernel.int8}",
              "answers": len(texts), "tokens": scored}
    greedy = {}
    for name, (engine, mode) in arms.items():
        if mode is not None:
            kernel.activations = mode
        seqs = engine.generate([ids for ids, _ in texts],
                               SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        nll = -sum(e.logprob for s, (_, head) in zip(seqs, texts) for e in s.prompt_logprobs[head:])
        result[f"ppl_{name}"] = round(math.exp(nll / scored), 4)
        greedy[name] = [s.output_ids for s in engine.generate(
            greedy_ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))]
    kernel.activations = cpu_quant.requested_activations()
    base, other = arms
    result["ppl_change_%"] = round(100 * (result[f"ppl_{other}"] / result[f"ppl_{base}"] - 1), 3)
    result["greedy_first_divergence"] = {
        i: next((j for j, (a, b) in enumerate(zip(f, q)) if a != b), None)
        for i, (f, q) in enumerate(zip(greedy[base], greedy[other]))}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
