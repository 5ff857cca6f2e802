"""What this machine and the probes cost, measured once, checked, cached, and used to account
for a recording: the machine's roofs (`machine_roofs`) and the verdicts against them
(`roofline`); a probe hit's price in a loop (`probecost`), inside the calls the collector
times (`insitu`) and as a running engine pays it (`enginetrap`, cached by `engineprice`); the
one quiet-machine check every measurement passes (`loadcheck`); the C microbenchmarks
(`nativebuild`, `native/`); the calibration stamped into a recording (`stamped`); CPU time
(`cputime`); and what profiling cost the target (`selfcost`). It imports the rooms below it."""
