"""What the daemon exports: its Prometheus series (metrics), OTLP (otlp), and the GPU's own
state through NVML (nvml)."""
