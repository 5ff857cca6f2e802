"""The kernel side: a ctypes binding of the system's libbpf (`libbpf`), what the running
kernel offers (`kernel`), BPF objects built once and cached by content or shipped in the wheel
(`bpfobj`; compiled by `bpfbuild`, which the wheel's build uses too), their
records as numpy dtypes from the shared headers (`layout`), the event transport (`transport`),
perf events (`perf_event_open`, `perfevents`), and the maps pinned in bpffs that every
profinfer on the node shares: the processes a record follows (`followed`) and those a
daemon's discovery holds (`held`), with `pinned` and `make_pins`. `bpf/` holds the core's BPF
programs and the headers every plug-in's programs include. It imports the rooms below it."""
