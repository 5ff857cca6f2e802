"""An ELF file's reader, refused where its header claims more sections or segments than a
shared object has. A tenant's header can put a section count of 2^30 in section 0 (the
extended count), and pyelftools walks section headers one at a time (~11.5 µs each): a name
looked up in such a file would take hours, wherever it is read."""
from __future__ import annotations

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

# a shared object has tens of each; 4096 sections are walked in ~50 ms
MAX_SECTIONS = 4096
MAX_SEGMENTS = 1024


def elf_file(f) -> ELFFile:
    """pyelftools' ELFFile of the open file `f`; ELFError (what its readers raise for a
    malformed file, so what every caller already handles) past the bounds above."""
    elf = ELFFile(f)
    sections, segments = elf.num_sections(), elf.num_segments()
    if sections > MAX_SECTIONS or segments > MAX_SEGMENTS:
        raise ELFError(f"its header claims {sections} sections and {segments} segments "
                       f"(at most {MAX_SECTIONS} and {MAX_SEGMENTS} are read)")
    return elf
