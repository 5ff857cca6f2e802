"""The bundled vLLM workload: a plain offline generation, as a user runs it (the engine core
in a child process). `profinfer demo --engine vllm` records it; so does a test.

    python generate.py MODEL [TOKENS [OUT_JSON]]

OUT_JSON: the engine's own counts: per request its prompt and generated tokens, and the
steps its scheduler ran (its iteration histogram's count: vLLM's stats, kept only then).
"""
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402

if __name__ == "__main__":
    model = sys.argv[1]
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    out = sys.argv[3] if len(sys.argv) > 3 else None
    llm = LLM(model=model, enforce_eager=True, max_model_len=512, dtype="bfloat16", seed=0,
              disable_log_stats=out is None)
    outputs = llm.generate(["hello world model token", "the cache of the attention layer",
                            "query key value"], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                           use_tqdm=False)
    if out is not None:
        steps = sum(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total")
        with open(out, "w") as f:
            json.dump({"requests": [{"prompt_tokens": len(o.prompt_token_ids), "generated": len(o.outputs[0].token_ids)}
                                    for o in outputs], "steps": steps}, f)
