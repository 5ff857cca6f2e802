"""A vLLM engine under steady decode load, and a burst of long prompts when asked (runs in
vLLM's venv): the flight recorder's vLLM test.

    python steady_burst.py MODEL

Drives the engine step by step (LLMEngine.step): RUNNING requests with short prompts and
long outputs decode all the time (a new one takes a finished one's place). Prints READY
after its warm-up. Commands on its stdin: `BURST SECONDS` adds a long prompt (ONE output
token) before every step for that long, so that the steps mix prefill with the decodes;
`STOP` ends it, after it prints its truth: one JSON line, each step as the engine's own
scheduler made it ([CLOCK_MONOTONIC s, its sequences' new tokens]).
"""
import json
import os
import queue
import sys
import threading
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402

RUNNING = 4
LONG_PROMPT = [10 + i % 90 for i in range(384)]

llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=512, dtype="bfloat16", seed=0)
engine = llm.llm_engine
decoding = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate(["warm up the engine"], decoding, use_tqdm=False)

scheduler = engine.engine_core.engine_core.scheduler
steps = []
schedule = scheduler.schedule


def recording_schedule(*a, **kw):
    out = schedule(*a, **kw)
    if out.total_num_scheduled_tokens:
        steps.append([time.monotonic(), sorted(out.num_scheduled_tokens.values())])
    return out


scheduler.schedule = recording_schedule
commands: queue.Queue = queue.Queue()
threading.Thread(target=lambda: [commands.put(line.split()) for line in sys.stdin], daemon=True).start()
print("READY", flush=True)
n, decoding_now, burst_until = 0, 0, 0.0
while True:
    try:
        cmd = commands.get_nowait()
    except queue.Empty:
        cmd = None
    if cmd and cmd[0] == "STOP":
        break
    if cmd and cmd[0] == "BURST":
        burst_until = time.monotonic() + float(cmd[1])
    while decoding_now < RUNNING:
        n += 1
        engine.add_request(f"d{n}", "a steady stream of tokens", decoding)
        decoding_now += 1
    if time.monotonic() < burst_until:
        n += 1
        engine.add_request(f"b{n}", {"prompt_token_ids": LONG_PROMPT}, one)
    for out in engine.step():
        # (the engine may add to the ids it was given)
        if out.finished and out.request_id.startswith("d"):
            decoding_now -= 1
print(json.dumps({"steps": steps}), flush=True)
