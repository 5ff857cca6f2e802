"""Writers that turn a Profile into files: JSON summary, Perfetto and Chrome traces."""
