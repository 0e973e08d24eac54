"""`odma-bench peer`'s llama.cpp side (odma/bench/peer_servers.py, peer_report.py): llama-server runs as its
maintainers run it (f16 KV at odma's KV bytes, flash attention on, its default sampler chain), with the same compute
threads; the start log's slot layout is recorded; the ratios compare odma with the best of llama.cpp's slot
settings. No server starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from odma.bench import peer_report
from odma.bench.peer_servers import RunningServer, ServerSpec, command


def flags(cmd: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(cmd, cmd[1:]) if a.startswith("-")}


def test_llamacpp_runs_with_its_defaults_f16_kv_and_flash_attention_at_the_same_threads(tmp_path):
    kv_bytes, per_token = 1 << 30, 23040  # SmolLM2: 30 layers x K and V x 3 heads x 64 x 2 bytes (f16)
    spec = ServerSpec("llamacpp", "llamacpp-s16", tmp_path, kv_bytes, 1, python="/opt/llama-server",
                      gguf=tmp_path / "m.gguf", kv_tokens=kv_bytes // per_token, slots=16, unified=False)
    cmd, env = command(spec, 8123)
    f = flags(cmd)
    assert cmd[0] == "/opt/llama-server" and f["-m"] == str(tmp_path / "m.gguf") and env == {}
    assert (f["-c"], f["-np"], f["-ctk"], f["-ctv"], f["-t"], f["-tb"]) == ("46603", "16", "f16", "f16", "1", "1")
    assert (f["-fa"], f["-cram"], f["--alias"]) == ("on", "0", "smollm2")
    assert "--top-k" not in cmd and "--min-p" not in cmd and "--samplers" not in cmd  # its default chain
    assert "-no-kvu" in cmd and "-kvu" not in cmd and "--metrics" in cmd
    f32 = flags(command(ServerSpec("llamacpp", "f", tmp_path, kv_bytes, 1, python="x", gguf=Path("m"), kv_tokens=9,
                                   slots=16, kv_type="f32"), 1)[0])
    assert (f32["-ctk"], f32["-ctv"]) == ("f32", "f32")
    with pytest.raises(ValueError, match="KV type"):
        command(ServerSpec("llamacpp", "q", tmp_path, kv_bytes, 1, python="x", gguf=Path("m"), kv_tokens=9, slots=1,
                           kv_type="q8_0"), 1)
    unified, _ = command(ServerSpec("llamacpp", "u", tmp_path, kv_bytes, 2, python="x", gguf=Path("m"), kv_tokens=9,
                                    slots=128), 1)
    assert "-kvu" in unified and flags(unified)["-np"] == "128" and flags(unified)["-t"] == "2"


def test_odma_serves_either_the_fp32_folder_or_the_gguf_natively(tmp_path):
    dense, _ = command(ServerSpec("odma", "odma", tmp_path, 1 << 30, 1), 1)
    native, _ = command(ServerSpec("odma", "odma-native", tmp_path, 1 << 30, 1, gguf=tmp_path / "q.gguf"), 1)
    assert (flags(dense)["--model"], flags(dense)["--dtype"]) == (str(tmp_path), "float32")
    assert (flags(native)["--model"], flags(native)["--weights"]) == (str(tmp_path / "q.gguf"), "native")
    assert "--dtype" not in native


def test_the_start_log_says_how_many_kv_tokens_llamacpp_took(tmp_path):
    log = tmp_path / "l.log"
    capped = "llama_context: n_ctx_seq (23552) > n_ctx_train (8192)\nn_slots = 16, n_ctx_slot = 8192, kv_unified = 'true'"
    for text, tokens in (("n_slots = 16, n_ctx_slot = 1536, kv_unified = 'false'", 16 * 1536),
                         ("n_slots = 128, n_ctx_slot = 23552, kv_unified = 'true'", 23552), (capped, 23552)):
        log.write_text("load_model: initializing, " + text + "\n")
        facts = RunningServer(None, "", 0, log, 0.0).log_facts()
        assert facts["kv_tokens"] == tokens and facts["slots"] in (16, 128)


def test_the_ratios_compare_odma_with_llamacpps_best_setting():
    run = lambda tps, ttft: {"throughput_tps": tps, "ttft_p50_s": ttft, "itl_mean_s": 0.1}  # noqa: E731
    point = lambda c, tps: {"streams": c, "output_tps": tps, "ttft_p50_s": 1.0}  # noqa: E731
    result = {"stages": {
        "nq": {"odma-native": run(120.0, 2.0), "llamacpp-u128": run(30.0, 9.0), "llamacpp-s16": run(40.0, 4.0),
               "llamacpp-s64": {"error": "did not start"}},
        "guidellm": {"odma-native": {"points": [point(16, 90.0)]},
                     "llamacpp-u16": {"points": [point(16, 60.0)]}, "llamacpp-s16": {"points": [point(16, 45.0)]}},
    }}
    r = peer_report.ratios(result)
    assert r["nq vs llamacpp-s16"] == {"throughput": 3.0, "ttft_p50": 0.5, "ttft_p99": None, "itl": 1.0,
                                       "latency_mean": None}
    assert r["guidellm_c16 vs llamacpp-u16"]["throughput"] == 1.5
    assert "nq" not in r  # no vLLM run: no odma ÷ vLLM ratio
    assert "| llamacpp-s64 | error: did not start |" in peer_report.table(result)


def test_runs_made_one_at_a_time_merge_into_one_comparison_and_refuse_other_settings():
    run = lambda tps: {"throughput_tps": tps, "ttft_p50_s": 1.0}  # noqa: E731
    base = {"kv_bytes": 1 << 30, "threads": 1, "sampling": {"temperature": 0.7}, "machine": {"cpu": "x"},
            "llamacpp": {"model": "q4_1"}}
    first = {**base, "command": "a", "stages": {"nq": {"odma-native": run(120.0), "llamacpp-u16": run(30.0)}}}
    second = {**base, "command": "b", "finished": "later", "stages": {"nq": {"llamacpp-s16": run(40.0)}}}
    merged = peer_report.merge([first, second])
    assert set(merged["stages"]["nq"]) == {"odma-native", "llamacpp-u16", "llamacpp-s16"}
    assert merged["ratios"]["nq vs llamacpp-s16"]["throughput"] == 3.0 and merged["commands"] == ["a", "b"]
    assert merged["finished"] == "later"
    for change, word in (({"threads": 2}, "threads"), ({"machine": {"cpu": "y"}}, "cpu"),
                         ({"llamacpp": {"model": "f32"}}, "llamacpp model")):
        with pytest.raises(ValueError, match=word):
            peer_report.merge([first, {**second, **change}])
    with pytest.raises(ValueError, match="nq: llamacpp-u16, odma-native ran in more than one"):
        peer_report.merge([first, {**second, "stages": first["stages"]}])


BATCHED_BENCH = """
main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0, n_gpu_layers = -1
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.108 |  1186.64 |    3.079 |    41.57 |    3.187 |    80.32 |
|   128 |    128 |   16 |   4096 |    1.570 |  1304.68 |    8.455 |   242.23 |   10.024 |   408.60 |
"""


def test_the_batched_bench_ceiling_is_parsed_and_odma_is_compared_with_it():
    from odma.bench.peer_bench import parse_batched_bench

    rows = parse_batched_bench(BATCHED_BENCH)
    assert [(r["batch"], r["s_tg"], r["s_pp"]) for r in rows] == [(1, 41.57, 1186.64), (16, 242.23, 1304.68)]
    point = lambda c, tps: {"streams": c, "output_tps": tps, "ttft_p50_s": 1.0}  # noqa: E731
    result = {"llamacpp_ceiling": {"rows": rows},
              "stages": {"guidellm": {"odma-native": {"points": [point(1, 50.0), point(16, 200.0)]}}}}
    r = peer_report.ratios(result)
    # a served output rate counts each request from its arrival, prefill included: the engine's like figure is its
    # B * TG generated tokens over its whole time T; decode-only S_TG is reported beside
    assert r["guidellm_c1 vs llama-batched-bench"]["throughput"] == pytest.approx(50 / (128 / 3.187), abs=1e-3)
    assert r["guidellm_c16 vs llama-batched-bench"]["throughput"] == pytest.approx(200 / (16 * 128 / 10.024), abs=1e-3)
    assert r["guidellm_c16 vs llama-batched-bench"]["vs_s_tg"] == pytest.approx(200 / 242.23, abs=1e-3)
    assert "B=16 204.3 (242.2)" in peer_report.table({**result, "ratios": r})


def test_repeats_give_each_ratio_and_row_its_median_and_spread():
    run = lambda tps: {"throughput_tps": tps, "ttft_p50_s": 1.0, "itl_mean_s": 0.1}  # noqa: E731
    rounds = []
    for i, (odma, llama) in enumerate(((100.0, 50.0), (90.0, 60.0), (120.0, 40.0))):
        best = "llamacpp-u32" if i < 2 else "llamacpp-s16"  # the best setting of a round may change
        result = {"order": ["odma", "llamacpp"][:: 1 if i % 2 == 0 else -1], "round": i + 1,
                  "stages": {"nq": {"odma": run(odma), best: run(llama), "llamacpp-u64": run(llama / 2)}}}
        result["ratios"] = peer_report.ratios(result)
        rounds.append(result)
    summary = peer_report.repeats(rounds)
    ratio = summary["ratios"]["nq vs llama.cpp's best"]
    assert ratio["rounds"] == [2.0, 1.5, 3.0] and ratio["median"] == 2.0 and (ratio["min"], ratio["max"]) == (1.5, 3.0)
    assert ratio["settings"] == ["llamacpp-u32", "llamacpp-u32", "llamacpp-s16"]
    assert summary["throughput_tps"]["nq odma"]["median"] == 100.0
    assert summary["orders"] == [["odma", "llamacpp"], ["llamacpp", "odma"], ["odma", "llamacpp"]]
    assert "| nq vs llama.cpp's best | 2.0 | 1.5 | 3.0 | 2.0 (llamacpp-u32), 1.5 (llamacpp-u32), 3.0 (llamacpp-s16) |" \
        in peer_report.repeats_table(summary)


def test_the_table_counts_odmas_kv_in_its_own_dtype():
    from odma.bench.peer_bench import _odma_kv_dtype

    assert _odma_kv_dtype("") == "float16"  # the CPU default
    assert _odma_kv_dtype("--kv-dtype float32 --threads 1") == "float32"
    assert _odma_kv_dtype("--kv-dtype=bfloat16") == "bfloat16"
    result = {"kv_bytes": 46080 * 1000, "kv_bytes_per_token": 46080, "odma_kv_dtype": "float16"}
    assert "odma 2,000 float16 tokens" in peer_report.table(result)
    assert "odma 1,000 float32 tokens" in peer_report.table({**result, "odma_kv_dtype": "float32"})


def test_vllm_runs_its_own_default_dtype_when_asked_and_the_log_says_which(tmp_path):
    fp32, _ = command(ServerSpec("vllm", "vllm", tmp_path, 1 << 30, 1), 1)
    auto, _ = command(ServerSpec("vllm", "vllm", tmp_path, 1 << 30, 1, dtype="auto"), 1)
    assert (flags(fp32)["--dtype"], flags(auto)["--dtype"]) == ("float32", "auto")
    log = tmp_path / "v.log"
    log.write_text("Initializing a V1 LLM engine (v0.32.0) with config: model='/m', dtype=torch.bfloat16, "
                   "max_seq_len=2048\n")
    assert RunningServer(None, "", 0, log, 0.0).log_facts()["dtype"] == "bfloat16"


def test_each_gguf_file_gives_odma_and_llamacpp_rows_of_their_own(tmp_path):
    from argparse import Namespace

    from odma.bench.peer_bench import _specs, quant_tag

    files = [tmp_path / "llama-3.2-1b.Q4_K_M.gguf", tmp_path / "llama-3.2-1b.Q4_0.gguf"]
    args = Namespace(gguf=",".join(map(str, files)), odma_weights="native", threads=1, max_model_len=2048,
                     odma_args="", llamacpp_args="", llamacpp_kv="unified", llamacpp_slots="16",
                     llamacpp_kv_type="f16", llamacpp_samplers="default", vllm_args="", vllm_dtype="auto")
    odma = _specs("odma", 1 << 30, 32768, tmp_path, Path("py"), None, args)
    llama = _specs("llamacpp", 1 << 30, 32768, tmp_path, Path("py"), {"binary": "/bin/llama-server"}, args)
    vllm = _specs("vllm", 1 << 30, 32768, tmp_path, Path("py"), None, args)
    assert [(s.label, s.gguf) for s in odma] == [("odma-q4_k_m", files[0]), ("odma-q4_0", files[1])]
    assert [(s.label, s.gguf) for s in llama] == [("llamacpp-q4_k_m-u16", files[0]), ("llamacpp-q4_0-u16", files[1])]
    assert llama[0].kv_tokens == (1 << 30) // 16384  # the same bytes in f16
    assert vllm[0].dtype == "auto" and quant_tag(Path("x/model.F32.gguf")) == "f32"


def test_an_odma_file_row_is_compared_with_llamacpp_on_the_same_file():
    point = lambda c, tps: {"streams": c, "output_tps": tps, "ttft_p50_s": 1.0}  # noqa: E731
    ceiling = lambda s: {"rows": [{"pp": 128, "tg": 128, "batch": 16, "s_pp": 1, "s_tg": s, "s": 1, "t_s": 16.0}]}  # noqa: E731
    result = {"stages": {"guidellm": {
        "odma-q4_k_m": {"points": [point(16, 60.0)]}, "odma-q4_0": {"points": [point(16, 90.0)]},
        "llamacpp-q4_k_m-u16": {"points": [point(16, 30.0)]}, "llamacpp-q4_0-u16": {"points": [point(16, 45.0)]}}},
        "llamacpp_ceilings": {"q4_k_m": ceiling(200.0), "q4_0": ceiling(300.0)}}
    r = peer_report.ratios(result)
    assert r["guidellm_c16[odma-q4_k_m] vs llamacpp-q4_k_m-u16"]["throughput"] == 2.0
    assert r["guidellm_c16[odma-q4_0] vs llamacpp-q4_0-u16"]["throughput"] == 2.0
    # B=16 x 128 tokens over 16 s: 128 tok/s on either file; S_TG is each file's own
    assert r["guidellm_c16[odma-q4_0] vs llama-batched-bench"]["vs_s_tg"] == 0.3
    summary = peer_report.repeats([{**result, "ratios": r}])
    assert "guidellm_c16[odma-q4_0] vs llama.cpp's best" in summary["ratios"]
    assert "llama-batched-bench q4_0 B=16 S_TG" in summary["throughput_tps"]


def test_the_memory_sampler_sees_the_peak_of_the_whole_process_group():
    import subprocess
    import sys
    import time

    from odma.bench.peer_servers import MemorySampler, stop

    # a parent and a child that each hold ~150 MB for a moment: together ~300 MB at once
    code = ("import subprocess, sys, time; x = bytearray(150 << 20); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; x = bytearray(150 << 20); time.sleep(3)']); "
            "time.sleep(3); c.wait()")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        with MemorySampler(proc.pid, every_s=0.1) as memory:
            time.sleep(2.5)
        assert memory.peak_mb > 280 and 280 < memory.peak_pss_mb <= memory.peak_mb
    finally:
        stop(proc)
