"""What the vLLM collector probes in a process, and where: the native ops read from the `_C`
libraries themselves (ops), torch's kernel wrappers the op probes sit on where they can
(wrappers), and c10::TensorImpl's layout in the target's torch (tensors)."""
