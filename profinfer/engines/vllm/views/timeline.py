"""vLLM's tracks in a Perfetto trace: engine steps and native op calls.

On each thread's track, by category: step (name = phase; tokens, calls, query_lens "1,1,4")
> native_op (name = op; "arg:<name>" = "dtype[s0,s1,...]" per tensor argument, "-" for an
empty optional; library, depth, step (the thread's step number), values where read); nested
calls one level deeper. The threads of each process that ran ops (the workers) belong to it.
"""
from __future__ import annotations

from profinfer.core.profile.model import OpCall, Step, TensorArg
from profinfer.core.plugin.timeline import INT, LEVEL_BATCH, LEVEL_GRAPH, STR, SliceKind, Timeline

CAT_STEP, CAT_CALL = "step", "native_op"
CALL_ARG_PREFIX = "arg:"      # a tensor argument: "dtype[s0,s1,...]", "-" for an empty optional


def tensor_str(dtype: str, shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else f"{dtype}[{','.join(map(str, shape))}]"


def parse_tensor(text: str) -> tuple[str, tuple[int, ...] | None]:
    if text == "-":
        return "", None
    dtype, _, dims = text.partition("[")
    dims = dims.rstrip("]")
    return dtype, tuple(int(d) for d in dims.split(",")) if dims else ()


class StepKind(SliceKind):
    category, field = CAT_STEP, "steps"

    def begin(self, obj: Step):
        return CAT_STEP, obj.phase, (("tokens", INT, obj.n_tokens), ("calls", INT, obj.n_calls),
                                     ("query_lens", STR, ",".join(map(str, obj.query_lens))))

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        lens = begin_args.get("query_lens", "")
        return Step(reader.pid_of(tid), tid, start, end_args.get("end_ns", ts), begin_args["tokens"],
                    tuple(int(x) for x in lens.split(",") if x), begin_args.get("calls", 0))


class CallKind(SliceKind):
    category, field = CAT_CALL, "calls"

    def begin(self, obj: OpCall):
        args = tuple((CALL_ARG_PREFIX + a.name, STR, tensor_str(a.dtype, a.shape)) for a in obj.args)
        args += (("library", STR, obj.library), ("depth", INT, obj.depth), ("step", INT, obj.step))
        if obj.values:
            args += (("values", STR, ",".join(map(str, obj.values))),)
        return CAT_CALL, obj.op, args

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        args = tuple(TensorArg(k[len(CALL_ARG_PREFIX):], *parse_tensor(v))
                     for k, v in begin_args.items() if k.startswith(CALL_ARG_PREFIX))
        values = tuple(int(v) for v in begin_args["values"].split(",")) if begin_args.get("values") else ()
        return OpCall(reader.pid_of(tid), tid, start, end_args.get("end_ns", ts), name, args,
                      begin_args.get("depth", 0), begin_args.get("library", ""), values,
                      begin_args.get("step", 0))


class VllmTimeline(Timeline):
    def __init__(self):
        self.step, self.call = StepKind(), CallKind()
        self.kinds = (self.step, self.call)

    def slices(self, profile):
        for s in profile.steps:
            yield self.step, s, LEVEL_BATCH
        for c in profile.calls:
            yield self.call, c, LEVEL_GRAPH + c.depth

    def thread_pids(self, profile):
        return {c.tid: c.pid for c in profile.calls}


TIMELINE = VllmTimeline()
