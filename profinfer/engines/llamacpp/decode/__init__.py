"""What llama.cpp's probes send and count, made into profile objects while collecting: the
event records parsed between polls (records), raw op and graph records turned into columns
and calls (assemble), the counts BPF keeps in place of events (totals), and the backend each
graph compute ran on (backends)."""
