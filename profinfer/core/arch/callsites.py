"""Call sites of a function inside given callers: a uprobe on `call f` in the caller fires
only for that caller's calls, where one on f's entry fires for every caller."""
from __future__ import annotations

import os
import re
from functools import lru_cache

import capstone
import numpy as np
from capstone import x86_const as X
from elftools.elf.elffile import ELFFile

from profinfer.core import procfs
from profinfer.core.symbols import MAX_TABLE_BYTES, ElfInfo, open_checked

_md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_md.detail = True
_BATCH = 4096      # instructions decoded per capstone call (direct_calls)


# Elf64_Rela, parsed in bulk (pyelftools decodes one relocation at a time: ~0.3 s a library).
_RELA64 = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])
_SYM64_NAME = np.dtype([("name", "<u4"), ("rest", "V20")])


@lru_cache(maxsize=16)
def plt_stubs(path: str, file_id: tuple[int, int]) -> dict[int, str]:
    """{PLT stub address: name of the function it jumps to} (.plt and .plt.sec), read from
    the file `file_id` (the one the symbols came from)."""
    with open_checked(path, file_id) as f:
        elf = ELFFile(f)
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
        elf = ELFFile(f)
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
