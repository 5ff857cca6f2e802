"""Which x86-64 instructions this kernel emulates at a uprobe, measured: what a hit costs on
each kind of first instruction (bench/probe_emulation.c), by thread CPU time per call with a
uprobe on it against without, in alternating rounds. An emulated instruction costs a trap
(~0.5 µs here); one the kernel single-steps out of line costs two and more (~15 µs); one it
refuses cannot be probed at all (perf_event_open fails).

    /work/main/.venv/bin/python bench/probe_emulation.py [--json OUT]

Prints a markdown table (instruction, bytes, µs per hit, verdict). Run it on an idle machine:
the verdict has a wide margin (30x), the µs figures do not.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from profinfer.core.ebpf.perf_event_open import perf_event_open          # noqa: E402
from profinfer.core.calibration.probecost import _uprobe_attr                    # noqa: E402
from profinfer.core.target.symbols import load_elf                          # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# (function, bytes into it where the probe goes, the instruction there as objdump writes it)
CASES = [
    ("push_rbx", 0, "push %rbx"), ("push_r12", 0, "push %r12"), ("push_rbp", 0, "push %rbp"),
    ("endbr64", 0, "endbr64"), ("nop1", 0, "nop"), ("xchg_ax_ax", 0, "xchg %ax,%ax (66 90)"),
    ("nopl3", 0, "nopl (%rax)"), ("nopl4", 0, "nopl 0x0(%rax)"),
    ("nop5", 0, "nopl 0x0(%rax,%rax,1) (nop5)"), ("nopw6", 0, "nopw 0x0(%rax,%rax,1)"),
    ("nopl7", 0, "nopl 0x0(%rax) (7 bytes)"), ("nopl8", 0, "nopl 0x0(%rax,%rax,1) (8 bytes)"),
    ("nopw9", 0, "nopw 0x0(%rax,%rax,1) (9 bytes)"), ("nopw_cs10", 0, "cs nopw (10 bytes)"),
    ("jmp_rel8", 0, "jmp rel8"), ("jmp_rel32", 0, "jmp rel32"), ("jcc_rel8", 3, "je rel8"),
    ("jcc_rel32", 3, "je rel32"), ("jrcxz", 0, "jrcxz rel8"), ("loop", 0, "loop rel8"),
    ("call_rel32", 0, "call rel32"), ("mov_rdi_rax", 0, "mov %rdi,%rax"),
    ("sub_rsp", 0, "sub $0x8,%rsp"), ("lea_r10_rsp", 0, "lea 0x8(%rsp),%r10"),
    ("mov_rsp_rbp", 1, "mov %rsp,%rbp"), ("push_imm", 0, "push $0x0"),
]
CALLS, ROUNDS = 40_000, 3
STEPPED_ABOVE_NS = 3000        # emulated ~500 ns, single-stepped ~15000: the gap is wide


def build(name: str = "probe_emulation") -> str:
    """bench/NAME.c, compiled."""
    out = os.path.join(tempfile.mkdtemp(prefix=f"{name}."), name)
    subprocess.run(["gcc", "-O2", "-o", out, os.path.join(HERE, f"{name}.c")], check=True)
    return out


def alternate(binary: str, args: list[str], offset: int, rounds: int,
              warmup: int = 0, probed_file: str | None = None) -> tuple[list[float], list[float]] | None:
    """ns per call of each plain and each probed round of `binary ARGS` (which prints one
    line a round, after reading one), a uprobe at `offset` in it (or in `probed_file`, a
    library it loads) in alternate rounds, after `warmup` pairs of rounds left out; None: the
    probe is refused."""
    total = 2 * (rounds + warmup)
    proc = subprocess.Popen([binary, *args, str(total)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    plain, probed = [], []
    try:
        for r in range(total):
            fd = -1
            if r % 2:
                attr, _buf = _uprobe_attr((probed_file or binary).encode(), offset, False)
                fd = perf_event_open(attr, proc.pid, -1)
                if fd < 0:
                    return None
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
                ns = float(proc.stdout.readline())
                if r >= 2 * warmup:
                    (probed if r % 2 else plain).append(ns)
            finally:
                if fd >= 0:
                    os.close(fd)
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()
    return plain, probed


def measure(binary: str, function: str, offset: int) -> float | None:
    """ns a hit adds (median probed round minus median plain round); None: refused."""
    rounds = alternate(binary, [function, str(CALLS)], offset, ROUNDS)
    return None if rounds is None else statistics.median(rounds[1]) - statistics.median(rounds[0])


def write_json(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"kernel": platform.release(), "rows": rows}, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    binary = build()
    syms = load_elf(binary).symbols
    rows = []
    print(f"kernel {platform.release()}\n\n| first instruction | µs per hit | kernel |\n|---|---|---|")
    for fn, off, insn in CASES:
        ns = measure(binary, fn, syms[f"pe_{fn}"].file_offset + off)
        verdict = ("refused" if ns is None else
                   "single-stepped" if ns > STEPPED_ABOVE_NS else "emulated")
        rows.append({"function": fn, "instruction": insn, "ns": ns, "verdict": verdict})
        print(f"| `{insn}` | {'-' if ns is None else f'{ns / 1e3:.2f}'} | {verdict} |", flush=True)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
