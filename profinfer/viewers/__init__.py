"""Terminal views of a Profile."""
