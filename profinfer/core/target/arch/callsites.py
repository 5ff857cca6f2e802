"""Call sites of a function inside given callers: a uprobe on `call f` in the caller fires
only for that caller's calls, where one on f's entry fires for every caller."""
from __future__ import annotations

import os
import re
from functools import lru_cache

import capstone
import numpy as np
from capstone import x86_const as X

from profinfer.core.target import parsing, procfs
from profinfer.core.target.elfheaders import elf_file
from profinfer.core.target.symbols import MAX_TABLE_BYTES, ElfInfo, open_checked

parsing.preload(__name__)      # its readings run in the parse worker: imported there before it is confined

_md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_md.detail = True
_BATCH = 4096      # instructions decoded per capstone call (direct_calls)


# Elf64_Rela, parsed in bulk (pyelftools decodes one relocation at a time: ~0.3 s a library).
_RELA64 = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])
_SYM64_NAME = np.dtype([("name", "<u4"), ("rest", "V20")])


@lru_cache(maxsize=16)
def plt_stubs(path: str, file_id: tuple[int, int]) -> dict[int, str]:
    """{PLT stub address: name of the function it jumps to} (.plt and .plt.sec), read from
    the file `file_id` (the one the symbols came from), in the parse worker (a tenant's file:
    NotReady while it reads it)."""
    return parsing.run(("plt_stubs", file_id), __name__, "read_plt_stubs", path, file_id)


def read_plt_stubs(path: str, file_id: tuple[int, int]) -> dict[int, str]:
    """plt_stubs, read here."""
    with open_checked(path, file_id) as f:
        elf = elf_file(f)
        rela = elf.get_section_by_name(".rela.plt")
        if rela is None or rela.header.sh_entsize != _RELA64.itemsize:
            return {}
        dynsym = elf.get_section(rela.header.sh_link)
        if max(rela.header.sh_size, dynsym.header.sh_size,
               elf.get_section(dynsym.header.sh_link).header.sh_size) > MAX_TABLE_BYTES:
            return {}
        strtab = elf.get_section(dynsym.header.sh_link).data()
        name_offs = np.frombuffer(dynsym.data(), _SYM64_NAME)["name"]
        relocs = np.frombuffer(rela.data(), _RELA64)

        def name(sym_index: int) -> str:
            off = int(name_offs[sym_index])
            return strtab[off:strtab.find(b"\0", off)].decode("utf-8", "replace")

        slots = {int(r["offset"]): name(int(r["info"]) >> 32) for r in relocs}
        stubs: dict[int, str] = {}
        for sec_name in (".plt.sec", ".plt"):
            sec = elf.get_section_by_name(sec_name)
            if sec is None:
                continue
            for insn in _md.disasm(sec.data(), sec.header.sh_addr):
                if insn.id != X.X86_INS_JMP or not insn.operands:
                    continue
                op = insn.operands[0]
                if op.type == X.X86_OP_MEM and op.mem.base == X.X86_REG_RIP:
                    target = slots.get(insn.address + insn.size + op.mem.disp)
                    if target:
                        # A stub starts 16-aligned; endbr64 may precede the jmp.
                        stubs.setdefault(insn.address & ~0xF, target)
        return stubs


def call_sites(elf: ElfInfo, callers: str, target: str) -> list[tuple[str, int]]:
    """(caller symbol, offset in it) of every `call target` in functions matching `callers`."""
    rx = re.compile(callers)
    callers_here = [(n, s) for n, s in sorted(elf.symbols.items()) if rx.match(n) and s.size]
    if not callers_here:
        return []
    direct = elf.find(target)
    stubs = {a for a, n in plt_stubs(elf.path, elf.file_id).items() if n == target}
    wanted = stubs | ({direct.vaddr} if direct else set())
    sites = []
    for name, sym in callers_here:
        for insn in _md.disasm(elf.code_bytes(sym, sym.size), sym.vaddr):
            if (insn.id == X.X86_INS_CALL and insn.operands and insn.operands[0].type == X.X86_OP_IMM
                    and insn.operands[0].imm in wanted):
                sites.append((name, insn.address - sym.vaddr))
    return sites


def direct_calls(path: str, target_vaddr: int) -> list[tuple[int, int]]:
    """(vaddr, file offset) of every `call target_vaddr` in the file's .text, found by
    disassembling it from its start (a probe placed at a chance match of bytes inside another
    instruction would corrupt every process that runs it). For a function whose own first
    instruction the kernel would single-step (glibc's _dl_debug_state is one `ret`), its call
    sites are emulated: a uprobe there costs ~0.5 µs instead of ~15 µs. One linear pass: a
    byte that decodes to no instruction is stepped over in place (capstone's skipdata), and
    no more of .text is read than the file holds (a tenant's file: its header can claim any)."""
    with procfs.open_binary(path) as f:
        elf = elf_file(f)
        text = elf.get_section_by_name(".text")
        if text is None or text["sh_type"] != "SHT_PROGBITS":
            return []
        base, offset = text["sh_addr"], text["sh_offset"]
        f.seek(offset)
        code = bytearray(f.read(max(0, min(text["sh_size"], os.fstat(f.fileno()).st_size - offset))))
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.skipdata = True
    want, out, at, view = hex(target_vaddr), [], 0, memoryview(code)
    while at < len(code):
        start = at
        # a bytearray's view is passed by reference (no copy); capstone keeps every decoded
        # instruction of a call until it returns (~250 bytes each): a bounded count a call
        for address, size, mnemonic, op_str in md.disasm_lite(view[at:], base + at, _BATCH):
            if mnemonic == "call" and op_str == want:
                out.append((address, address - base + offset))
            at = address - base + size
        if at <= start:        # nothing decoded (skipdata decodes every byte): never stuck
            break
    return out


_INT_ARGS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
_CALLER_SAVED = {"rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11"}
_SUB = {"eax": "rax", "ax": "rax", "al": "rax", "ah": "rax", "ebx": "rbx", "bx": "rbx", "bl": "rbx",
        "bh": "rbx", "ecx": "rcx", "cx": "rcx", "cl": "rcx", "ch": "rcx", "edx": "rdx", "dx": "rdx",
        "dl": "rdx", "dh": "rdx", "esi": "rsi", "si": "rsi", "sil": "rsi", "edi": "rdi", "di": "rdi",
        "dil": "rdi", "ebp": "rbp", "bp": "rbp", "bpl": "rbp", "esp": "rsp", "sp": "rsp", "spl": "rsp"}


def _reg64(insn, reg: int) -> str:
    name = insn.reg_name(reg)
    if name in _SUB:
        return _SUB[name]
    if name.startswith("r") and name[-1] in "dwb" and name[1:-1].isdigit():
        return name[:-1]
    return name


def _indirect(insn) -> bool:
    ops = insn.operands
    return insn.id in (X.X86_INS_CALL, X.X86_INS_JMP) and bool(ops) and ops[0].type != X.X86_OP_IMM


def call_through_slot(code: bytes, first_reads_slot: bool, slot: int, whole: bool) -> int | None:
    """The offset of the instruction that the function's call through the code pointer at
    `slot` into an object returns to:
    - its first indirect transfer, where that reads the slot (`first_reads_slot`: what
      indirect_call_slot found of it; a tail jump: None);
    - else, where `code` is the whole function (`whole`), its only indirect transfer, a call
      through `slot` bytes into some object (`call *slot(%r)`, or `call *%r` where the last
      write of %r before it is `mov slot(%x),%r`).
    None otherwise: the call is not one these show."""
    if first_reads_slot:
        first = next((i for i in _md.disasm(code, 0) if _indirect(i)), None)
        return first.address + first.size if first is not None and first.id == X.X86_INS_CALL else None
    if not whole:
        return None
    insns = list(_md.disasm(code, 0))
    indirect = [i for i in insns if _indirect(i)]
    if len(indirect) != 1 or indirect[0].id != X.X86_INS_CALL:
        return None
    call = indirect[0]
    op = call.operands[0]
    if op.type == X.X86_OP_MEM:
        ok = bool(op.mem.base) and not op.mem.index and op.mem.disp == slot
    else:
        reg = _reg64(call, op.reg)
        writes = [i for i in insns if i.address < call.address
                  and reg in {_reg64(i, r) for r in i.regs_access()[1]}]
        last = writes[-1] if writes else None
        ok = (last is not None and last.id == X.X86_INS_MOV and len(last.operands) == 2
              and last.operands[1].type == X.X86_OP_MEM and last.operands[1].mem.disp == slot
              and bool(last.operands[1].mem.base) and not last.operands[1].mem.index)
    return call.address + call.size if ok else None


def jumped_into(code: bytes, lo: int, hi: int) -> bool:
    """Whether a relative jump anywhere in `code` lands in [lo, hi] (offsets from its start):
    code there is then reached by another path too."""
    for insn in _md.disasm(code, 0):
        if (capstone.CS_GRP_JUMP in insn.groups and insn.operands
                and insn.operands[0].type == X.X86_OP_IMM and lo <= insn.operands[0].imm <= hi):
            return True
    return False


def after_call_to(code: bytes, targets: set[int]) -> int | None:
    """The offset of the instruction the first call in `code` of one of `targets` returns
    to (offsets from the code's start, as a call's operand decodes at base 0); None where
    there is none."""
    for insn in _md.disasm(code, 0):
        if (insn.id == X.X86_INS_CALL and insn.operands and insn.operands[0].type == X.X86_OP_IMM
                and insn.operands[0].imm in targets):
            return insn.address + insn.size
    return None


def indirect_call_slot(code: bytes, arg: int) -> int | None:
    """The offset, in the object that integer argument `arg` (1-based) points to at entry,
    of the code pointer through which the function's first indirect call (or tail jump)
    goes: `call *off(%reg)`, or `mov off(%reg),%r; ... call *%r`, with reg holding the
    argument (copied to another register or spilled to the stack and reloaded on the way).
    One pass in address order over the first bytes of the function; None where that first
    indirect transfer is not through the argument (the caller then does not trust it)."""
    holds = {_INT_ARGS[arg - 1]}          # registers and stack slots holding the pointer
    loaded: dict[str, int] = {}           # register: offset of the word loaded from it
    for insn in _md.disasm(code, 0):
        ops = insn.operands
        indirect = (insn.id in (X.X86_INS_CALL, X.X86_INS_JMP) and ops
                    and ops[0].type != X.X86_OP_IMM)
        if indirect:
            op = ops[0]
            if op.type == X.X86_OP_REG:
                return loaded.get(_reg64(insn, op.reg))
            mem = op.mem
            if mem.base and not mem.index and _reg64(insn, mem.base) in holds:
                return mem.disp
            return None
        if insn.id == X.X86_INS_RET or (insn.id == X.X86_INS_JMP and ops):
            return None                 # the entry block ends without one
        if insn.id == X.X86_INS_CALL:   # a direct call: the caller-saved registers are lost
            holds -= _CALLER_SAVED
            loaded = {r: o for r, o in loaded.items() if r not in _CALLER_SAVED}
            continue
        src = dst = None
        if insn.id == X.X86_INS_MOV and len(ops) == 2:
            dst, src = ops
        _, written = insn.regs_access()
        for r in written:
            holds.discard(_reg64(insn, r))
            loaded.pop(_reg64(insn, r), None)
        if src is None:
            continue
        if src.type == X.X86_OP_REG and _reg64(insn, src.reg) in holds:
            if dst.type == X.X86_OP_REG:
                holds.add(_reg64(insn, dst.reg))
            elif dst.mem.base and not dst.mem.index:        # spilled to a stack slot
                holds.add(f"{_reg64(insn, dst.mem.base)}{dst.mem.disp:+d}")
        elif src.type == X.X86_OP_MEM and dst.type == X.X86_OP_REG and src.mem.base and not src.mem.index:
            base = _reg64(insn, src.mem.base)
            if f"{base}{src.mem.disp:+d}" in holds:          # reloaded from its stack slot
                holds.add(_reg64(insn, dst.reg))
            elif base in holds:
                loaded[_reg64(insn, dst.reg)] = src.mem.disp
        elif dst.type == X.X86_OP_MEM and dst.mem.base and not dst.mem.index:
            holds.discard(f"{_reg64(insn, dst.mem.base)}{dst.mem.disp:+d}")   # overwritten
    return None
