"""Host-to-device, device-to-host and device-to-device copies of tensors of known sizes (every
copy the process makes); writes to argv[1] their calls and bytes by kind, as the script knows
them and as CUPTI saw them."""
import torch
from torch.profiler import ProfilerActivity, profile

import cupti_truth

# element counts and dtypes: odd sizes, so that no two kinds' totals agree by chance
TENSORS = [(1 << 20, torch.float32), (300_001, torch.uint8), (12_345, torch.float16), (7, torch.int64)]


def main() -> None:
    torch.cuda.init()
    mine: dict[str, dict] = {}

    def copied(kind: str, t: torch.Tensor) -> None:
        c = mine.setdefault(kind, {"calls": 0, "bytes": 0})
        c["calls"] += 1
        c["bytes"] += t.numel() * t.element_size()

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for n, dtype in TENSORS:
            host = torch.ones(n, dtype=dtype)                    # pageable
            d = host.to("cuda")                                  # H2D, then a sync
            copied("H2D", host)
            pinned = torch.ones(n, dtype=dtype, pin_memory=True)
            d2 = pinned.to("cuda", non_blocking=True)            # H2D, async
            copied("H2D", pinned)
            e = torch.empty_like(d)
            e.copy_(d2)                                          # D2D: same device, contiguous
            copied("D2D", d2)
            back = e.cpu()                                       # D2H
            copied("D2H", e)
            assert torch.equal(back, host)
        torch.cuda.synchronize()
    cupti_truth.write({"copies": mine, "cupti": cupti_truth.seen(prof)})


if __name__ == "__main__":
    main()
