"""The neutral profile: what one run observed, whoever collected it and whatever engine ran.
The model every exporter, viewer and trace reader shares (`model`), op slices stored as
columns (`opcolumns`), sequences from decode calls (`sequences`), the numbers every report
derives (`stats`) and the log-linear histogram BPF keeps where calls are counted
(`loghist`). Pure logic: no I/O, no BPF; it imports only `base`."""
