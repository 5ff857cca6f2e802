"""A torch function captured into a CUDA graph and replayed; writes to argv[1] what CUPTI saw:
the eager launches (every one the process makes outside the capture), what one eager call of
the function launches (what its capture must hold), and the replays' cudaGraphLaunch calls."""
import torch
from torch.profiler import ProfilerActivity, profile

import cupti_truth

REPLAYS = 25
WARMUP = 3


def body(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 2.0 + 1.0).sum()


def profiled(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, cupti_truth.seen(prof)


def main() -> None:
    torch.cuda.init()
    x, setup = profiled(lambda: torch.randn(1 << 16, device="cuda"))
    _, one_call = profiled(lambda: body(x))

    def warmup():                          # on a side stream, as torch's CUDA graph docs say
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(WARMUP):
                body(x)
        torch.cuda.current_stream().wait_stream(s)
    _, warm = profiled(warmup)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):              # not profiled: CUPTI and capture are kept apart
        body(x)

    def replay():
        for _ in range(REPLAYS):
            g.replay()
    _, replays = profiled(replay)
    eager = sum(sum(t["kernels"].values()) for t in (setup, one_call, warm))
    cupti_truth.write({"replays": REPLAYS, "eager_launches": eager, "one_call": one_call["kernels"],
                       "graph_launch_calls": replays["api"].get("cudaGraphLaunch", 0),
                       "replayed_kernels": sum(replays["kernels"].values())})


if __name__ == "__main__":
    main()
