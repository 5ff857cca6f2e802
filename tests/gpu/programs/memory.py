"""Device memory through torch's caching allocator: tensors made, freed, the cache emptied
(its segments given back with cudaFree), more made; writes to argv[1] what the allocator says
of its segments (each one a cudaMalloc) and of its tensors."""
import os

# one cudaMalloc per segment (expandable segments map memory through the driver instead)
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"

import torch  # noqa: E402

import cupti_truth  # noqa: E402

MiB = 1 << 20


def main() -> None:
    a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")     # a large segment of its own
    b = torch.empty(3 * MiB + 123, dtype=torch.uint8, device="cuda")
    c = torch.empty(1000, dtype=torch.float32, device="cuda")        # the small pool's 2 MiB
    torch.cuda.synchronize()
    del a
    torch.cuda.empty_cache()                                          # a's segment: cudaFree
    d = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    cupti_truth.write({
        "memory_allocated": torch.cuda.memory_allocated(),
        "memory_reserved": torch.cuda.memory_reserved(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "segments_allocated": s["segment.all.allocated"], "segments_freed": s["segment.all.freed"],
        "reserved_bytes_allocated": s["reserved_bytes.all.allocated"],
        "reserved_bytes_freed": s["reserved_bytes.all.freed"],
        "tensors": [t.numel() * t.element_size() for t in (b, c, d)],
    })


if __name__ == "__main__":
    main()
