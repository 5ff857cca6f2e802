"""A vLLM engine process that generates when asked (runs in vLLM's venv): the governor's timed
test sets two of these (one watched, one not) against each other in alternating windows.

    python on_demand.py MODEL eager|compiled

Prints READY after its warm-up, then for each line `RUN n` on its stdin generates the same
batch (4 requests x 32 tokens) n times and prints `DONE <batches a second>`, timed by itself
(CLOCK_MONOTONIC). Between requests it waits on its stdin: idle, no CPU.
"""
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402

model, mode = sys.argv[1], sys.argv[2]
llm = LLM(model=model, enforce_eager=mode == "eager", max_model_len=512, dtype="bfloat16", seed=0)
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
prompts = ["hello world model token", "the cache of the attention layer", "query key value",
           "a thread of the server engine and its graph"]
llm.generate(prompts, params, use_tqdm=False)            # warm-up
print("READY", flush=True)
for line in sys.stdin:
    n = int(line.split()[1])
    t0 = time.monotonic()
    for _ in range(n):
        llm.generate(prompts, params, use_tqdm=False)
    print(f"DONE {n / (time.monotonic() - t0)}", flush=True)
