"""Eager torch ops on the GPU, every kernel of the process launched inside one torch.profiler
region; writes what CUPTI saw there (cupti_truth) to argv[1].

    python eager.py TRUTH.json [--matmul]     # --matmul: cuBLAS's kernels too
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import cupti_truth

ITERATIONS = 20


def main() -> None:
    matmul = "--matmul" in sys.argv[2:]
    torch.cuda.init()                      # the context, before profiling: no kernel
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        x = torch.randn(1 << 20, device="cuda")
        y = torch.randn(1 << 20, device="cuda")
        for _ in range(ITERATIONS):
            z = torch.relu(x + y) * 2.0
            s = z.sum()
        if matmul:
            a = torch.randn(512, 256, device="cuda")
            b = torch.randn(256, 384, device="cuda")
            for _ in range(5):
                c = torch.nn.functional.linear(a @ b, b)   # two GEMM shapes: (512, 384), (512, 256)
        torch.cuda.synchronize()
    cupti_truth.write({"iterations": ITERATIONS, "matmul": matmul, "cupti": cupti_truth.seen(prof)})


if __name__ == "__main__":
    main()
