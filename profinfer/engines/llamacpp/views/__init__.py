"""llama.cpp's profiles read and shown (pure logic over a Profile): graph nodes across threads
(nodes), the computation graph and its terminal view (dag, dagview), ggml's roofline cost
model (cost), time per layer and against the context (layers), MoE routing (moe), the
quantities `diff` compares (comparable), and the plug-in's report sections (report) and
Perfetto tracks (timeline)."""
