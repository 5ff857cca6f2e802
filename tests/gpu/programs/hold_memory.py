"""Hold argv[1] MiB of device memory until stdin closes (at most 120 s), so that NVML and
nvidia-smi have a process and a known amount of memory to report. Prints "ready <pid>"."""
import os
import select
import sys

import torch

held = torch.ones(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(f"ready {os.getpid()}", flush=True)
select.select([sys.stdin], [], [], 120)
