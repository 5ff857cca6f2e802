"""Probe placement per instruction set: x86-64 (decoded with capstone); others are refused."""
