"""llama.cpp / ggml: its decoder (collector), ggml structures, graph walk, op assembly, workload."""
