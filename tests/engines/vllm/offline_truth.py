"""A vLLM offline engine that records its own truth, driven over stdin: one engine per mode
serves every test that asks for it (tests/conftest.py's vllm_engine), profinfer attached to it
and detached between generations.

    python offline_truth.py MODEL eager|compiled

It prints READY once past its warm-up; then it takes one JSON line at a time on stdin:
- {"truth": PATH, "seconds": S}: it generates the prompts once (S = 0), or again and again
  until S seconds have passed, writes that generation's truth to PATH and prints DONE. A
  generation of S seconds runs without torch.profiler (its teardown of so many calls would
  take minutes): its truth is the scheduler's steps, and no calls. A generation of the tiny
  model takes a fraction of a second, shorter than a daemon's judgment needs.
- {"steady": PATH}: steady decode load, step by step (LLMEngine.step): RUNNING requests with
  short prompts and long outputs decode all the time (a new one takes a finished one's place),
  until {"stop": true}, which writes the steps to PATH and prints DONE. Meanwhile
  {"burst": S} adds a long prompt (one output token) before every step for S seconds, so that
  the steps mix prefill with the decodes.

Truth, from inside the process: torch.profiler's record of every `_C` op call (name, input
shapes and dtypes, with the schema's argument names from torch's own op registry), the
engine's scheduler outputs (tokens per request in each step, and when: CLOCK_MONOTONIC s), and
the calling thread's time on a CPU (the kernel's schedstat), for that generation only.
"""
import contextlib
import json
import os
import queue
import sys
import threading
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

model, mode = sys.argv[1:3]
llm = LLM(model=model, enforce_eager=mode == "eager", max_model_len=512, dtype="bfloat16", seed=0)
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
prompts = ["hello world model token", "the cache of the attention layer",
           "query key value", "a thread of the server engine and its graph"]
llm.generate(prompts[:1], params, use_tqdm=False)          # warm-up, not profiled

scheduler = llm.llm_engine.engine_core.engine_core.scheduler
steps = []
schedule = scheduler.schedule


def recording_schedule(*a, **kw):
    out = schedule(*a, **kw)
    if out.total_num_scheduled_tokens:
        steps.append([time.monotonic(), sorted(out.num_scheduled_tokens.values())])
    return out


scheduler.schedule = recording_schedule


def on_cpu_ns() -> int:
    """This thread's time on a CPU, as the kernel's scheduler counts it."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[0])


def generation(truth_path: str, seconds: float) -> None:
    steps.clear()
    cpu0, t0 = on_cpu_ns(), time.monotonic_ns()
    profiled = not seconds
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) if profiled else contextlib.nullcontext() as prof:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        while time.monotonic_ns() - t0 < seconds * 1e9:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    t1, cpu1 = time.monotonic_ns(), on_cpu_ns()
    calls = []
    for e in prof.events() if profiled else ():
        if not e.name.startswith("_C::"):
            continue
        name = e.name.split("::", 1)[1]
        schema = getattr(torch.ops._C, name).default._schema
        args = {}
        for arg, shape, dtype in zip(schema.arguments, e.input_shapes, e.input_dtypes):
            if "Tensor" in str(arg.type):
                args[arg.name] = None if not dtype else {"dtype": dtype, "shape": list(shape)}
        calls.append({"op": name, "args": args})
    with open(truth_path, "w") as f:
        json.dump({"start_ns": t0, "end_ns": t1, "calls": calls, "steps": [lens for _, lens in steps],
                   "tid": threading.get_native_id(), "on_cpu_ns": cpu1 - cpu0,
                   "generated": [list(o.outputs[0].token_ids) for o in outputs]}, f)


RUNNING = 4                                     # decoding all the time under steady load
LONG_PROMPT = [10 + i % 90 for i in range(384)]
decoding = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def steady(truth_path: str, commands: queue.Queue) -> None:
    engine = llm.llm_engine
    steps.clear()
    n, decoding_now, burst_until = 0, 0, 0.0
    while True:
        try:
            asked = commands.get_nowait()
        except queue.Empty:
            asked = {}
        if asked.get("stop"):
            break
        if "burst" in asked:
            burst_until = time.monotonic() + float(asked["burst"])
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
    with open(truth_path, "w") as f:
        json.dump({"steps": list(steps)}, f)
    while engine.has_unfinished_requests():     # the next generation starts from none
        engine.step()


commands: queue.Queue = queue.Queue()          # read all along: steady load polls it
threading.Thread(target=lambda: [commands.put(json.loads(line)) for line in sys.stdin] + [commands.put(None)],
                 daemon=True).start()
print("READY", flush=True)
while (asked := commands.get()) is not None:
    if "steady" in asked:
        steady(asked["steady"], commands)
    else:
        generation(asked["truth"], float(asked.get("seconds", 0)))
    print("DONE", flush=True)
# Gone at once at the end of its input: the interpreter's teardown frees the engine's layers,
# and their oneDNN handlers' release is a native op call of its own (release_dnnl_matmul_handler,
# once a linear layer), which would be no generation's
os._exit(0)
