"""The daemon's HTTP side: its endpoints and who may read what (server), the connection
handling a hostile client cannot hold (listener), the client the CLI uses (client), the
control token (tokens) and TLS (tls)."""
