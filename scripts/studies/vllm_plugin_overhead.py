"""vLLM's per-step scheduling cost with and without odma.vllm, in one process (the scheduler and the model on one
thread, so cProfile sees both): 16 prompts x 128 greedy tokens on SmolLM2 fp32, twice, after a warm-up.

    PEER_PYTHON scripts/studies/vllm_plugin_overhead.py stock|plugin [MODEL_DIR]
"""
import cProfile
import os
import pstats
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: the engine in this process
from vllm import LLM, SamplingParams  # noqa: E402
plugin = sys.argv[1] == "plugin"
MODEL = sys.argv[2] if len(sys.argv) > 2 else os.path.expanduser("~/.cache/odma/models/SmolLM2-135M-Instruct.Q4_1")
kw = dict(model=MODEL, dtype="float32", max_model_len=2048,
          kv_cache_memory_bytes=1 << 30, max_num_seqs=128, enforce_eager=True)
if plugin:
    kw.update(scheduler_cls="odma.vllm.Scheduler", additional_config={"odma": {"order": "adaptive"}})
llm = LLM(**kw)
prompts = [f"Tell me a long story about number {i} and the sea." for i in range(16)]
sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
llm.generate(prompts[:2], sp, use_tqdm=False)
pr = cProfile.Profile()
t = time.perf_counter()
pr.enable()
for _ in range(2):
    llm.generate(prompts, sp, use_tqdm=False)
pr.disable()
print(sys.argv[1], "time", round(time.perf_counter() - t, 2))
st = pstats.Stats(pr)
st.sort_stats("cumulative")
st.print_stats(r"odma|scheduler.py:.*\(schedule\)|update_from_output|execute_model", 25)
