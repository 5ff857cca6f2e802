"""What the vLLM collector probes in a process, and where, and what its probes cost: the native
ops read from the `_C` libraries themselves (ops), torch's kernel wrappers the op probes sit on
where they can (wrappers), c10::TensorImpl's layout in the target's torch (tensors), the plan
of ops, probe sites and op specs resolved at attach (probeplan), and the probe hits' cost and
the trap measured in the target (probecost)."""
