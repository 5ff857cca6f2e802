"""Finding the inference processes on the node: the kernel's side (kernel: exec and loader
hooks, held processes), looking at each candidate (finder), what was seen of each process
(seen), whose it is (tenants) and what to call it (identity)."""
