"""The engine-neutral core of profinfer, in rooms that import only downward:

    base -> profile -> target -> ebpf -> calibration -> diff -> plugin -> (here)

Here, at the top: one profiling session (`session`: attach, poll, detach, the Profile) and
the follower of what a recorded command becomes (`follow`), and the pricing of an engine's
hits by driving sessions of it (`pricing`). tests/test_layering.py holds
the order; each room's package says what it is for."""
