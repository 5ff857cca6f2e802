"""The cuda level: CUDA runtime and driver calls (launches with kernel names, copies, syncs)."""
from profinfer.core.base.registry import Level

PLUGIN = Level("cuda", __name__, title="CUDA", bpf="cuda.bpf.c", collector="collector:CudaCollector", timeline="timeline", report="report", process_caches="names",
               daemon_metrics="metrics")
