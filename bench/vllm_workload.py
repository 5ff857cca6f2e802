"""The vLLM benchmark's target (runs in vLLM's venv): one engine process generating the same
batch again and again, printing each batch's start and end (CLOCK_MONOTONIC ns) and its
steps, so that the benchmark can time windows with and without profinfer attached.

    python vllm_workload.py MODEL eager|compiled SECONDS
    python vllm_workload.py MODEL eager|compiled on-demand

on-demand (the governor's timed test, tests/daemon/governed.py: two of these set against each
other in alternating windows): for each line `RUN n` on its stdin it generates the batch n
times and prints `DONE <batches a second>`, timed by itself; between requests it waits on its
stdin, idle.
"""
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402

model, mode, seconds = sys.argv[1], sys.argv[2], sys.argv[3]
llm = LLM(model=model, enforce_eager=mode == "eager", max_model_len=512, dtype="bfloat16", seed=0)
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
prompts = ["hello world model token", "the cache of the attention layer", "query key value",
           "a thread of the server engine and its graph"]
llm.generate(prompts, params, use_tqdm=False)            # warm-up
print("READY", flush=True)
if seconds == "on-demand":
    for line in sys.stdin:
        n = int(line.split()[1])
        t0 = time.monotonic()
        for _ in range(n):
            llm.generate(prompts, params, use_tqdm=False)
        print(f"DONE {n / (time.monotonic() - t0)}", flush=True)
    sys.exit(0)
end = time.monotonic() + float(seconds)
while time.monotonic() < end:
    t0 = time.monotonic_ns()
    llm.generate(prompts, params, use_tqdm=False)
    print(f"BATCH {t0} {time.monotonic_ns()}", flush=True)
