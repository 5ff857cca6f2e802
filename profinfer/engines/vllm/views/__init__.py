"""vLLM's profiles read and shown (pure logic over a Profile): statistics of ops that are
calls (callstats), the roofline cost model of the ops its pack models (cost), the quantities
`diff` compares (comparable), and the plug-in's report sections (report) and Perfetto tracks
(timeline)."""
