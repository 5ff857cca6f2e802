"""What every other room of the core stands on: the one error the command line turns into a
line (`errors`), the PROFINFER_* settings each read once (`config`), and the registry of the
engines and levels profinfer knows, with the folders their BPF sources are found in
(`registry`). It imports no other room."""
