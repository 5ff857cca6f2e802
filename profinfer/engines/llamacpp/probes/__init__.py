"""What the llama.cpp collector probes in one build, and what a probe costs there: the pack's
probes resolved in the engine's libraries and the object's config (probeplan), ggml's
structures read from the binary (ggml), the graph loop's facts the one-probe op design needs
(graphwalk), and one probe hit's trap priced from the engine's own barrier (barrier, the
plug-in's `accounting`)."""
