"""lm-evaluation-harness' `local-completions` against a running odma-serve, one prompt a request against several
(`batch_size`), in alternating rounds: seconds, accuracy and whether the log-likelihoods are the same.

The task is local: the first --questions of NQ-open's dev set ($ODMA_DATA_DIR/nq_open), each with its answer and
three other questions' answers as choices (four loglikelihood requests a question). Start the server first
(`.venv/bin/odma-serve`), then:

    .venv/bin/python scripts/studies/lm_eval_batch.py --batch-sizes 1,8 --rounds 2 --json OUT.json
    .venv/bin/python scripts/studies/lm_eval_batch.py --in-engine 4     # no server: 16 prompts at once vs alone
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from odma.config import default_data_dir  # noqa: E402


def write_task(folder: Path, questions: int) -> None:
    rows = [json.loads(line) for line in (default_data_dir() / "nq_open" / "NQ-open.dev.jsonl").open()][:400]
    rng = random.Random(0)
    docs = []
    for i, row in enumerate(rows[:questions]):
        choices = [rows[j]["answer"][0] for j in rng.sample(range(len(rows)), 4) if j != i][:3] + [row["answer"][0]]
        rng.shuffle(choices)
        docs.append({"question": f"Question: {row['question']}?\nAnswer:", "choices": choices,
                     "answer": choices.index(row["answer"][0])})
    (folder / "nq_mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "nq_mc.yaml").write_text(
        "task: nq_mc\ndataset_path: json\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'nq_mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def evaluate(folder: Path, url: str, model: str, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.monotonic()
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["nq_mc"], log_samples=True,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        model_args={"model": model, "base_url": url + "/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": str(folder / "tokenizer"), "max_length": 2048, "batch_size": batch_size})
    seconds = time.monotonic() - started
    samples = sorted(out["samples"]["nq_mc"], key=lambda s: s["doc_id"])
    return {"batch_size": batch_size, "seconds": round(seconds, 2), "acc": out["results"]["nq_mc"]["acc,none"],
            "loglikelihoods": [[r[0] for r in s["filtered_resps"]] for s in samples]}


def in_engine(questions: int, argv: list[str]) -> float:
    """The largest difference (nats) between a prompt's summed log-likelihood scored alone and scored in one engine
    call with the other prompts of `questions` questions (no server: the default engine, odma-serve's `argv`)."""
    from odma.engine import LLMEngine, SamplingParams
    from odma.server.cli import build_parser, config_from_args

    engine = LLMEngine(config_from_args(build_parser().parse_args(argv)))
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), questions)
        docs = [json.loads(line) for line in (Path(tmp) / "nq_mc.jsonl").open()]
    prompts = [engine.tokenizer.encode(f"{d['question']} {c}", add_special_tokens=False) for d in docs
               for c in d["choices"]]
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)

    def scores(seqs) -> list[float]:
        return [sum(e.logprob for e in s.prompt_logprobs[1:]) for s in seqs]

    alone = [scores(engine.generate([p], scored))[0] for p in prompts]
    return max(abs(a - b) for a, b in zip(alone, scores(engine.generate(prompts, scored))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="default")
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write every run (with its log-likelihoods) here")
    p.add_argument("--in-engine", type=int, metavar="Q", help="instead: Q questions' prompts scored in one engine "
                   "call against each alone, in this process (no server); odma-serve's flags may follow `--`")
    args, rest = p.parse_known_args()
    if args.in_engine:
        print(json.dumps({"prompts": 4 * args.in_engine, "max_abs_diff_to_alone": in_engine(args.in_engine, rest)}))
        return 0
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    from odma.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(folder / "datasets")
        write_task(folder, args.questions)
        load_tokenizer("smollm2").hf.save_pretrained(str(folder / "tokenizer"))
        runs = [evaluate(folder, args.url, args.model, int(b))
                for _ in range(args.rounds) for b in args.batch_sizes.split(",")]
    first = runs[0]["loglikelihoods"]
    for run in runs:
        run["max_abs_diff_to_first"] = max(abs(a - b) for x, y in zip(first, run["loglikelihoods"]) for a, b in zip(x, y))
        print(json.dumps({k: v for k, v in run.items() if k != "loglikelihoods"}))
    if args.json:
        Path(args.json).write_text(json.dumps({"questions": args.questions, "runs": runs}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
