"""A vLLM offline engine that records its own truth, driven over stdin: one engine per mode
serves every test of a module (tests/conftest.py's vllm_engine), profinfer attached to it
and detached between generations.

    python offline_truth.py MODEL eager|compiled

It prints READY once past its warm-up; then, for each line {"truth": PATH, "seconds": S} on
stdin, it generates the prompts once (S = 0), or again and again until S seconds have passed,
writes that generation's truth to PATH and prints DONE. A generation of S seconds runs
without torch.profiler (its teardown of so many calls would take minutes): its truth is the
scheduler's steps, and no calls. A generation of the tiny model takes a fraction of a
second, shorter than a daemon's judgment needs.

Truth, from inside the process: torch.profiler's record of every `_C` op call (name, input
shapes and dtypes, with the schema's argument names from torch's own op registry), the
engine's scheduler outputs (tokens per request in each step), and the calling thread's time
on a CPU (the kernel's schedstat), for that generation only.
"""
import contextlib
import json
import os
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
        steps.append(sorted(out.num_scheduled_tokens.values()))
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
        json.dump({"start_ns": t0, "end_ns": t1, "calls": calls, "steps": list(steps),
                   "tid": threading.get_native_id(), "on_cpu_ns": cpu1 - cpu0,
                   "generated": [list(o.outputs[0].token_ids) for o in outputs]}, f)


print("READY", flush=True)
for line in sys.stdin:
    asked = json.loads(line)
    generation(asked["truth"], float(asked.get("seconds", 0)))
    print("DONE", flush=True)
# Gone at once at the end of its input: the interpreter's teardown frees the engine's layers,
# and their oneDNN handlers' release is a native op call of its own (release_dnnl_matmul_handler,
# once a linear layer), which would be no generation's
os._exit(0)
