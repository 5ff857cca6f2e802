"""What vLLM's probes send and count, made into profile objects while collecting: the native-op
calls parsed (calls), the engine's steps made from the calls of its step ops (steps), and the
counts BPF keeps in place of sending each call (totals)."""
