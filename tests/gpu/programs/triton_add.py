"""A @triton.jit kernel called a known number of times (Triton launches through the driver
API, cuLaunchKernel*); writes to argv[1] the count, and what CUPTI saw of those calls."""
import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

import cupti_truth

CALLS = 30
N, BLOCK = 100_000, 1024


@triton.jit
def pi_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


def main() -> None:
    x = torch.randn(N, device="cuda")
    y = torch.randn(N, device="cuda")
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    grid = (triton.cdiv(N, BLOCK),)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):             # the first call compiles, then launches
            pi_add_kernel[grid](x, y, out, N, BLOCK=BLOCK)
        torch.cuda.synchronize()
    assert torch.equal(out, x + y)         # the kernel ran
    seen = cupti_truth.seen(prof)
    cupti_truth.write({"calls": CALLS, "grid": list(grid), "block_size": BLOCK,
                       "cupti_launches": sum(n for k, n in seen["kernels"].items() if "pi_add_kernel" in k),
                       "cupti": seen})


if __name__ == "__main__":
    main()
