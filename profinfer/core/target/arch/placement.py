"""Where inside a function to put a uprobe so that it costs ~0.4 µs instead of ~16 µs.

The x86-64 kernel emulates a few instructions at a uprobe (push of a register, jmp/call
rel, jcc, and the nops of its own x86_nops table, 1 to 8 bytes); any other instruction
(endbr64 included) is single-stepped out of line, which traps twice (bench/probe_emulation.py
measures each kind; bench/results.md). So the probe goes on the first emulated instruction of
the function's entry block, provided that every call passes through it and the argument
registers the handler reads still hold the arguments there.

Only x86-64 code is decoded (here, in callsites.py and ggml.py): a binary for another
architecture is refused, not probed at offsets computed from misread instructions.
"""
from __future__ import annotations

from dataclasses import dataclass

import capstone
from capstone import x86_const as X
from elftools.common.exceptions import ELFError

from profinfer.core.target import procfs
from profinfer.core.target.elfheaders import elf_file
from profinfer.core.base.errors import ProfinferError

SUPPORTED_MACHINE = "EM_X86_64"
# pyelftools' e_machine names, as people call those architectures
_ARCH_NAMES = {"EM_AARCH64": "aarch64", "EM_386": "x86 (32-bit)", "EM_ARM": "arm (32-bit)",
               "EM_RISCV": "riscv", "EM_PPC64": "ppc64", "EM_S390": "s390x",
               "EM_LOONGARCH": "loongarch"}

_ARG_REGS = {1: X.X86_REG_RDI, 2: X.X86_REG_RSI, 3: X.X86_REG_RDX, 4: X.X86_REG_RCX,
             5: X.X86_REG_R8, 6: X.X86_REG_R9}
# Sub-registers alias their 64-bit parent: writing edi clobbers rdi.
_ALIASES = {
    X.X86_REG_RDI: {X.X86_REG_RDI, X.X86_REG_EDI, X.X86_REG_DI, X.X86_REG_DIL},
    X.X86_REG_RSI: {X.X86_REG_RSI, X.X86_REG_ESI, X.X86_REG_SI, X.X86_REG_SIL},
    X.X86_REG_RDX: {X.X86_REG_RDX, X.X86_REG_EDX, X.X86_REG_DX, X.X86_REG_DL, X.X86_REG_DH},
    X.X86_REG_RCX: {X.X86_REG_RCX, X.X86_REG_ECX, X.X86_REG_CX, X.X86_REG_CL, X.X86_REG_CH},
    X.X86_REG_R8: {X.X86_REG_R8, X.X86_REG_R8D, X.X86_REG_R8W, X.X86_REG_R8B},
    X.X86_REG_R9: {X.X86_REG_R9, X.X86_REG_R9D, X.X86_REG_R9W, X.X86_REG_R9B},
}

_md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_md.detail = True


def require_supported(path: str) -> None:
    """Refuse an ELF file whose code is not x86-64, naming its architecture."""
    try:
        with procfs.open_binary(path) as f:      # inside the target's root
            machine = elf_file(f).header.e_machine
    except (OSError, ELFError) as e:
        raise ProfinferError(f"cannot read the ELF header of {path}: {e}") from None
    if machine != SUPPORTED_MACHINE:
        arch = _ARCH_NAMES.get(machine, str(machine).removeprefix("EM_").lower())
        raise ProfinferError(f"{path} is built for {arch}: profinfer places probes by decoding "
                             "x86-64 code only")


@dataclass(frozen=True)
class Placement:
    offset: int        # bytes from the function's start
    emulated: bool     # False: the kernel must single-step here (expensive)
    instruction: str


# The kernel's x86_nops table (arch/x86/kernel/alternative.c): a uprobe on one of these exact
# encodings is emulated; other encodings of nop (a 9-byte nopw, prefixed ones) are not.
_KERNEL_NOPS = frozenset(bytes.fromhex(h) for h in (
    "90", "6690", "0f1f00", "0f1f4000", "0f1f440000", "660f1f440000", "0f1f8000000000",
    "0f1f840000000000"))

# relative jumps that are no jcc (the kernel emulates jcc, opcodes 70-7f and 0f 80-8f, only)
_NOT_EMULATED_JUMPS = frozenset((X.X86_INS_JRCXZ, X.X86_INS_JECXZ, X.X86_INS_JCXZ, X.X86_INS_LOOP,
                                 X.X86_INS_LOOPE, X.X86_INS_LOOPNE))


def _is_emulated(insn) -> bool:
    if bytes(insn.bytes) in _KERNEL_NOPS:
        return True
    if insn.id == X.X86_INS_PUSH and insn.operands and insn.operands[0].type == X.X86_OP_REG:
        return True
    if insn.id in (X.X86_INS_JMP, X.X86_INS_CALL):
        return bool(insn.operands) and insn.operands[0].type == X.X86_OP_IMM
    if insn.id in _NOT_EMULATED_JUMPS:
        return False
    return capstone.CS_GRP_JUMP in insn.groups and insn.operands and insn.operands[0].type == X.X86_OP_IMM


def emulated_at(code: bytes) -> tuple[bool, str]:
    """Whether the kernel emulates the instruction `code` begins with (a uprobe there costs one
    trap, else it is single-stepped), and that instruction ("" where none decodes)."""
    insn = next(_md.disasm(code[:16], 0), None)
    if insn is None:
        return False, ""
    return bool(_is_emulated(insn)), f"{insn.mnemonic} {insn.op_str}".strip()


def _ends_block(insn) -> bool:
    return (capstone.CS_GRP_JUMP in insn.groups or capstone.CS_GRP_RET in insn.groups
            or capstone.CS_GRP_CALL in insn.groups or insn.id in (X.X86_INS_INT3, X.X86_INS_UD2))


def choose(code: bytes, args_needed: tuple[int, ...] = ()) -> Placement:
    """Pick the cheapest probe offset in `code` (the function's first bytes).

    args_needed: 1-based argument numbers the handler reads from registers. The stack
    pointer is never moved before the chosen point, so stack arguments stay where the
    ABI puts them at entry.
    """
    watched = set().union(*(_ALIASES[_ARG_REGS[a]] for a in args_needed)) if args_needed else set()
    for insn in _md.disasm(code, 0):
        if _is_emulated(insn):
            return Placement(insn.address, True, f"{insn.mnemonic} {insn.op_str}".strip())
        if _ends_block(insn):
            break
        _, written = insn.regs_access()
        if watched & set(written):
            break
        if X.X86_REG_RSP in written or X.X86_REG_ESP in written:
            break
    return Placement(0, False, "")


def next_emulated(code: bytes, after: int) -> int | None:
    """The offset of the first emulated instruction past `after` in `code`'s entry block (run
    on every call that runs the instruction at `after`), or None: where a second probe costs
    the calls it is put in one more emulated trap and nothing else."""
    for insn in _md.disasm(code, 0):
        if insn.address > after and _is_emulated(insn) and insn.id != X.X86_INS_CALL \
                and capstone.CS_GRP_JUMP not in insn.groups:
            return insn.address
        if _ends_block(insn):
            return None
    return None


def first_emulated(code: bytes, start: int) -> int | None:
    """The offset of the first instruction from `start` on that the kernel emulates, where
    every run through `start` reaches it (no branch, call or return before it: a relative
    one is itself emulated and is the answer); None where there is none."""
    for insn in _md.disasm(code[start:], start):
        if _is_emulated(insn):
            return insn.address
        if _ends_block(insn):
            return None
    return None
