"""The probe predictor over a tiny served model: the engine's captured states equal the standalone ones, the
heads round-trip, odma-train --model probe trains, calibrates, evaluates (--json keys) and refines, and bad
input gives clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from odma.errors import PredictorError
from predictor import load_predictor
from predictor.probe import ProbePredictor
from predictor.probe.fit import fit_length_head, fit_ridge
from predictor.probe.hidden import ServedModelStates
from predictor.probe.identity import model_identity

FIXTURE = Path(__file__).resolve().parent.parent / "datasets" / "fixtures" / "predictor_tiny.jsonl"
EVAL_KEYS = ("spearman", "mae_tokens", "median_mae_tokens", "underprediction_rate", "mean_overreservation")

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (and chat template) as the served model."""
    from odma.models.tiny import make_tiny_model
    from odma.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2").hf
    folder = tmp_path_factory.mktemp("served")
    make_tiny_model(folder, vocab_size=len(tok), tie_word_embeddings=True,
                    eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """The tiny predictor fixture with answer texts whose length follows the prompt's kind."""
    rng = random.Random(0)
    rows = []
    for line in FIXTURE.read_text().splitlines():
        r = json.loads(line)
        r["output"] = " ".join(rng.choice(["river", "stone", "light"]) for _ in range(max(2, r.pop("output_tokens") // 8)))
        rows.append(r)
    path = tmp_path_factory.mktemp("trace") / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def trained(served, answers, tmp_path_factory):
    from training.pipeline import TrainOptions, train

    mp = pytest.MonkeyPatch()
    mp.setenv("ODMA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("run")
    report = train(TrainOptions(trace=str(answers), out=out, model="probe", served_model=str(served), target=0.1,
                                s3_baseline=False, progress=False, threads=1))
    yield out, report
    mp.undo()


def test_standalone_states_match_teacher_forcing_and_packing(served):
    states = ServedModelStates.load(str(served))
    states.max_batch_tokens = 64  # several packed batches
    seqs = [states.prompt_ids(p) for p in ("Name three rivers.", "Write an essay about bridges.", "Hi")]
    seqs.append(seqs[0] + seqs[1])
    last = states.last_states(seqs, (0, 1, 2))
    for i, s in enumerate(seqs):
        alone = states.last_states([s], (2,))[2][0]
        forced = states.states_at(s, [len(s) - 1], (0, 2))
        np.testing.assert_allclose(last[2][i], alone, atol=1e-5)
        np.testing.assert_allclose(last[2][i], forced[2][0], atol=1e-5)
        np.testing.assert_allclose(last[0][i], forced[0][0], atol=1e-6)
    with pytest.raises(Exception, match="positions"):
        states.states_at(seqs[0], [len(seqs[0])], (1,))


def test_engine_capture_equals_standalone_prefill_and_decode_states(served):
    """What the engine hands the probe (ModelRunner.capture_layers) is the standalone prefill's state at the end
    of the prompt, and the teacher-forced state at each decode step; capturing changes no token."""
    from odma.engine.sampling import SamplingParams
    from odma.engine.testing import tiny_engine

    states = ServedModelStates.load(str(served))
    prompt = states.prompt_ids("Explain how tides work.")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = tiny_engine(served, kv_budget="8MiB", max_tokens_cap=64).generate([prompt], params)[0].output_ids
    engine = tiny_engine(served, kv_budget="8MiB", max_tokens_cap=64)
    engine.runner.capture_layers = (1, 2)
    seq = engine.add_request(prompt, params)
    rows = []
    while not seq.finished:
        engine.step()
        rows.append({k: v[0].numpy().copy() for k, v in engine.runner.captured.items()})
    assert seq.output_ids == plain
    full = prompt + seq.output_ids
    forced = states.states_at(full, [len(prompt) - 1 + j for j in range(len(rows))], (1, 2))
    for j, row in enumerate(rows):  # row j: the step that fed prompt (j = 0) or the j-th generated token
        for layer in (1, 2):
            np.testing.assert_allclose(row[layer], forced[layer][j], atol=1e-4)
    engine.runner.capture_layers = ()
    engine.generate([prompt], params)
    assert engine.runner.captured == {}


def test_capture_rejects_layers_outside_the_model(served):
    from odma.models.llama import HiddenCapture

    states = ServedModelStates.load(str(served))
    with pytest.raises(Exception, match="capture layers"):
        states._forward([[1, 2, 3]], HiddenCapture((states.num_layers + 1,)))


def test_ridge_recovers_a_linear_signal_and_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 20)).astype(np.float32) * rng.uniform(0.1, 50, size=20).astype(np.float32)
    w = rng.normal(size=20) / x.std(0)
    y = x @ w + 3.0 + rng.normal(scale=0.05, size=400)
    head = fit_ridge(x, y)
    assert np.corrcoef(head.predict(x), y)[0, 1] > 0.99
    with pytest.raises(PredictorError, match="expects"):
        head.predict(x[:, :5])
    with pytest.raises(PredictorError, match="at least 2 rows"):
        fit_ridge(x[:1], y[:1])


def test_uncertainty_follows_the_error():
    """Where the length is noisier, u is larger."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2000, 4)).astype(np.float32)
    noisy = x[:, 0] > 0
    y_log = 4.0 + x[:, 1] + rng.normal(scale=np.where(noisy, 1.0, 0.05))
    head = fit_length_head(x, np.expm1(np.clip(y_log, 0, 7)), cap=2048)
    _, u = head.predict(x)
    assert u[noisy].mean() > u[~noisy].mean() + 0.2
    assert np.all((u >= 0) & (u < 1))


def test_train_report_has_the_keys_and_beats_the_median(trained):
    out, report = trained
    for key in EVAL_KEYS:
        assert report[key] is not None, key
    assert report["mae_tokens"] < report["median_mae_tokens"]
    assert report["spearman"] > 0.5
    manifest = json.loads((out / "predictor.json").read_text())
    assert manifest["kind"] == "probe" and manifest["calibration"]["target"] == 0.1
    assert manifest["settings"]["refine_layer"] is not None  # the trace has answers: a decode-time head
    assert "type" not in manifest["settings"]["metadata"]["vocab"]  # the engine never passes one
    cost = report["probe_cost"]
    assert cost["head_ms_batch1"] > 0 and cost["prefill_ms_batch1"] > 0
    assert report["refine"]["8"]["n"] > 0


def test_eval_only_json_has_the_issue_keys_and_reproduces_the_report(trained, answers, tmp_path):
    from training.cli import main

    out, report = trained
    f = tmp_path / "eval.json"
    assert main(["--eval-only", "--predictor", str(out), "--trace", str(answers), "--split", "test",
                 "--json", str(f), "--no-s3-baseline", "--quiet", "--threads", "1"]) == 0
    evaluated = json.loads(f.read_text())
    for key in EVAL_KEYS:
        assert evaluated[key] == report[key], key


def test_load_predict_refine_and_feature_api(trained, served):
    out, _ = trained
    predictor = load_predictor(str(out))
    assert isinstance(predictor, ProbePredictor)
    requests = [SimpleNamespace(prompt=p, prompt_tokens=20) for p in ("Write a long essay about rivers.", "Yes or no?")]
    standalone = predictor.predict(requests)
    states = ServedModelStates.load(str(served))
    rows = states.last_states([states.prompt_ids(r.prompt) for r in requests], (predictor.layer,))[predictor.layer]
    assert predictor.predict_features(torch.from_numpy(rows), requests) == standalone
    assert all(p.length >= 1 and 0 <= p.uncertainty < 1 for p in standalone)
    refined = predictor.refine(rows, [8, 40], requests)
    assert len(refined) == 2 and all(p.length >= 1 for p in refined)
    assert predictor.predict([SimpleNamespace(prompt=None, prompt_tokens=5)])[0].uncertainty == 1.0
    with pytest.raises(PredictorError, match="features must be"):
        predictor.predict_features(rows[:, :3], requests)
    with pytest.raises(PredictorError, match="non-finite"):
        predictor.predict_features(np.full_like(rows, np.nan), requests)
    with pytest.raises(PredictorError, match="one generated_so_far"):
        predictor.refine(rows, [8], requests)
    predictor.check_model(model_identity(states.model))
    with pytest.raises(PredictorError, match="trained on model"):
        predictor.check_model("0000000000000000")


def test_a_probe_refuses_another_models_states(trained, tmp_path):
    from odma.models.tiny import make_tiny_model

    out, _ = trained
    other = make_tiny_model(tmp_path / "other", seed=5, vocab_size=49152, tie_word_embeddings=True)
    from odma.models import load_model

    predictor = load_predictor(str(out))
    with pytest.raises(PredictorError, match="trained on model"):
        predictor.attach_model(ServedModelStates(load_model(other), None))


def test_corrupt_or_incomplete_probe_folders_fail_clearly(trained, tmp_path):
    import shutil

    out, _ = trained
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "probe_heads.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PredictorError, match="corrupt probe heads"):
        load_predictor(str(broken))
    (broken / "probe_heads.safetensors").unlink()
    with pytest.raises(PredictorError, match="missing probe_heads"):
        load_predictor(str(broken))
    shutil.copy(out / "probe_heads.safetensors", broken / "probe_heads.safetensors")
    manifest = json.loads((broken / "predictor.json").read_text())
    manifest["settings"]["hidden_size"] = 32
    (broken / "predictor.json").write_text(json.dumps(manifest))
    with pytest.raises(PredictorError, match="probe head takes"):
        load_predictor(str(broken))


def test_the_committed_answers_load_as_a_named_trace():
    """datasets/smollm2_answers: SmolLM2's own answers, capped at 512, every sample of a prompt in one split."""
    from collections import defaultdict

    from odma.traces import load_trace, split_trace

    trace = load_trace("smollm2-answers")
    assert trace.name == "smollm2-answers" and trace.meta["length_cap"] == 512 and len(trace) >= 1500
    assert all(r.output and 1 <= r.output_tokens <= 512 and r.generator == "SmolLM2-135M-Instruct" for r in trace)
    assert all(r.finished or r.output_tokens == 512 for r in trace)
    split_of = {}
    for name, part in zip(("train", "val", "test"), split_trace(trace)):
        split_of.update({r.request_id: name for r in part.records})
    by_prompt = defaultdict(set)
    for r in trace:
        by_prompt[r.request_id.split("#")[0]].add(split_of[r.request_id])
    assert all(len(s) == 1 for s in by_prompt.values())
    multi = [p for p in by_prompt if sum(r.request_id.startswith(p + "#") for r in trace) >= 5]
    assert len(multi) >= 200
    # drawn from the source traces' val/test splits; ShareGPT's source splits by conversation, this trace by prompt
    # text, so only the Alpaca and NQ ones are sure to stay out of training here
    assert {split for p in multi if not p.startswith("sharegpt") for split in by_prompt[p]} <= {"val", "test"}


def test_the_shipped_smollm2_probe_loads_by_name_and_ranks_an_essay_above_a_short_answer():
    """predictor/default/probe: trained by `odma-train --model probe --no-refine --trace smollm2-answers,nq`
    (docs/predictor.md); it reads the installed SmolLM2's own states."""
    from types import SimpleNamespace

    from predictor.registry import load_predictor

    probe = load_predictor("probe")
    assert probe.manifest.kind == "probe" and probe.calibration is not None
    assert probe.manifest.report["spearman"] >= 0.5  # the recorded test-split quality of what is shipped
    essay, capital = probe.predict([
        SimpleNamespace(prompt="Write a long, detailed essay about the history of the Roman Empire.", prompt_tokens=45),
        SimpleNamespace(prompt="What is the capital of France?", prompt_tokens=38)])
    cap = probe.calibration.large_bound
    assert all(1 <= p.length <= cap and 0 <= p.uncertainty <= 1 for p in (essay, capital))
    assert essay.length > 2 * capital.length
