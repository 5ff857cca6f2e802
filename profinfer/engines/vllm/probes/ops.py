"""vLLM's native ops, read from the library itself: no op list written for one release.

A torch custom-op library registers each op with its schema, a plain string in the binary
(`rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, ...) -> ()`),
and implements it in a C++ function of the same name, whose mangled symbol gives the C++
parameter types (`rotary_embedding(at::Tensor&, at::Tensor&, std::optional<at::Tensor>, long,
...)`). The schema gives the argument names and which are tensors; the C++ types give where
each one arrives (x86-64 System V): what BPF needs to read every tensor argument's shape.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import cxxfilt

from profinfer.core.target import parsing, procfs
from profinfer.core.target.elfheaders import elf_file
from profinfer.core.base.errors import ProfinferError
from profinfer.core.target.symbols import ElfInfo

parsing.preload(__name__)      # its readings run in the parse worker: imported there before it is confined

# the BPF side's argument kinds (bpf/vllm.h)
SKIP, TENSOR, OPT_TENSOR, STABLE_TENSOR, OPT_STABLE_TENSOR = 0, 1, 2, 3, 4
MAX_ARGS = 40
N_INT_REGS = 6
N_SSE_REGS = 8

# A schema: name(args) -> returns, NUL-terminated; args may hold parentheses (Tensor(a!)).
_SCHEMA = re.compile(rb"([a-z_][a-z0-9_]*)\(((?:[^()\x00]|\([^()\x00]*\))*)\)\s*->\s*([^\x00]*)\x00")


@dataclass(frozen=True)
class SchemaArg:
    name: str
    type: str            # the schema's type: "Tensor", "Tensor?", "int", "float", "str", ...

    @property
    def is_tensor(self) -> bool:
        base = re.sub(r"\(.*?\)", "", self.type).replace("!", "")
        return base in ("Tensor", "Tensor?")


@dataclass(frozen=True)
class Schema:
    name: str
    args: tuple[SchemaArg, ...]
    returns: str

    @property
    def returns_in_memory(self) -> bool:
        """A Tensor, tuple, list or string is returned through a hidden pointer (rdi)."""
        r = self.returns.strip()
        return r not in ("()", "bool", "int", "float", "SymInt", "ScalarType")


@dataclass(frozen=True)
class NativeOp:
    name: str
    schema: Schema
    symbol: str                   # the C++ function's (mangled) symbol
    signature: str                # demangled
    kinds: tuple[int, ...]        # per C++ parameter: SKIP or a tensor kind (bpf/vllm.h)
    slots: tuple[int, ...]        # per C++ parameter: integer slot (0-5 registers, 6 on: stack)

    @property
    def tensor_args(self) -> list[str]:
        """Names of the arguments BPF reads as tensors, in order."""
        return [self.schema.args[i].name for i, k in enumerate(self.kinds) if k != SKIP]


def _split_top(text: str, sep: str = ",") -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse_schema(name: str, args: str, returns: str) -> Schema:
    parsed = []
    for a in _split_top(" ".join(args.split())):
        a = a.split("=", 1)[0].strip()
        type_, _, aname = a.rpartition(" ")
        parsed.append(SchemaArg(aname, type_ or a))
    return Schema(name, tuple(parsed), " ".join(returns.split()))


def schemas(path: str) -> dict[str, Schema]:
    """Every op schema string in the library's read-only data, by op name (the file opened
    inside its process's root)."""
    found: dict[str, Schema] = {}
    try:
        f = procfs.open_binary(path)
    except OSError as e:
        raise ProfinferError(f"cannot read {path}: {e.strerror}") from None
    with f:
        elf = elf_file(f)
        for sec in elf.iter_sections():
            if sec.name not in (".rodata", ".data.rel.ro") and not sec.name.startswith(".rodata."):
                continue
            for m in _SCHEMA.finditer(sec.data()):
                name, args, ret = (g.decode("latin-1") for g in m.groups())
                found.setdefault(name, parse_schema(name, args, ret))
    return found


# How a C++ parameter type is passed: (kind for BPF, integer eightbytes, vector eightbytes).
# A class with a destructor or copy constructor (Tensor, shared_ptr, string, vector, SymInt,
# optional of those) goes by invisible reference: one pointer. Trivially copyable aggregates
# of two eightbytes (ArrayRef, optional<long>, optional<double>) take two registers, or the
# stack when they do not fit. None: a type not modelled (the op is not probed).
_SCALARS = {"long", "int", "bool", "unsignedlong", "unsignedint", "c10::ScalarType", "char",
            "longlong", "unsignedchar", "short", "signedchar", "std::optional<c10::ScalarType>",
            "std::optional<bool>", "std::optional<int>", "c10::Layout", "c10::MemoryFormat",
            "c10::Device", "std::optional<c10::Device>"}
_BY_REFERENCE = ("c10::SymInt", "std::__cxx11::basic_string", "std::basic_string", "std::vector<",
                 "c10::List<", "std::optional<at::Tensor", "std::optional<torch::stable::Tensor",
                 "std::optional<std::__cxx11::basic_string", "std::optional<std::vector<",
                 "at::Generator", "std::optional<at::Generator", "c10::Scalar",
                 "std::optional<c10::Scalar")


def _passing(cxx: str) -> tuple[int, int, int] | None:
    t = cxx.replace("const", "").replace(" ", "")
    by_ref = t.endswith("&")
    t = t.rstrip("&")
    if t == "at::Tensor":
        return TENSOR, 1, 0
    if t == "std::optional<at::Tensor>":
        return OPT_TENSOR, 1, 0
    if t in ("torch::stable::Tensor", "torch::headeronly::stable::Tensor"):
        return STABLE_TENSOR, 1, 0
    if t == "std::optional<torch::stable::Tensor>":
        return OPT_STABLE_TENSOR, 1, 0
    if by_ref or t.endswith("*") or t in _SCALARS or t.startswith(_BY_REFERENCE):
        return SKIP, 1, 0
    if t in ("double", "float"):
        return SKIP, 0, 1
    if t.startswith(("c10::ArrayRef<", "std::optional<long>")):
        return SKIP, 2, 0
    if t == "std::optional<double>":
        return SKIP, 1, 1
    return None


def _params(signature: str) -> list[str] | None:
    m = re.match(r"^[^(]*\((.*)\)\s*$", signature)
    if not m:
        return None
    inner = m.group(1).strip()
    return [] if inner in ("", "void") else _split_top(inner)


def describe(schema: Schema, symbol: str, leading: int = 0) -> NativeOp | None:
    """The op's argument passing, from its C++ signature; None where it is not modelled.
    leading: integer parameters before the op's own (a typed kernel wrapper's functor and
    dispatch key set, wrappers.py)."""
    try:
        signature = cxxfilt.demangle(symbol)
    except cxxfilt.InvalidName:
        return None
    params = _params(signature)
    if params is None or len(params) != len(schema.args) or len(params) > MAX_ARGS:
        return None
    reg = leading + (1 if schema.returns_in_memory else 0)
    stack = sse = 0
    kinds, slots = [], []
    for p in params:
        passing = _passing(p)
        if passing is None:
            return None
        kind, words, vector = passing
        sse += vector
        if sse > N_SSE_REGS:
            return None                  # vector arguments on the stack: not modelled
        if words == 0:
            kinds.append(SKIP)
            slots.append(0)
            continue
        if reg + words <= N_INT_REGS:
            slots.append(reg)
            reg += words
        else:                            # the whole argument goes on the stack
            slots.append(N_INT_REGS + stack)
            stack += words
        kinds.append(kind)
    if any(k != SKIP and not schema.args[i].is_tensor for i, k in enumerate(kinds)):
        return None                      # the C++ and schema disagree: not this op's function
    return NativeOp(schema.name, schema, symbol, signature, tuple(kinds), tuple(slots))


def _base_name(demangled: str) -> str:
    head = demangled.split("(", 1)[0]
    return head.rsplit("::", 1)[-1]


def _names_for(base: str) -> list[tuple[str, int]]:
    """The op names a function may implement, with their rank: 2 its own name; 1 each
    `_`-separated suffix (flash-attention implements `fwd` as mha_fwd,
    `get_scheduler_metadata` as mha_fwd_get_scheduler_metadata)."""
    names = [(base, 2)]
    i = base.find("_")
    while i != -1:
        if base[i + 1:]:
            names.append((base[i + 1:], 1))
        i = base.find("_", i + 1)
    return names


def declared_ops(elf: ElfInfo, declared: list[dict]) -> tuple[list[NativeOp], list[str]]:
    """Ops a pack names itself ([[op]] function = "..."): a program's own functions, probed
    as ops with no arguments read. Returns (those found, those not in this file)."""
    ops, missing = [], []
    for d in declared:
        fn = d["function"]
        if elf.find(fn) is None:
            missing.append(f"{fn} (not defined here)")
            continue
        ops.append(NativeOp(d.get("name", fn), Schema(d.get("name", fn), (), "()"), fn, fn, (), ()))
    return ops, missing


def native_ops(elf: ElfInfo) -> tuple[list[NativeOp], list[str]]:
    """The library's ops that can be probed, and the names of those that cannot (why)."""
    # all its read-only data, of a file a tenant may have made: read away from the daemon's loop
    found = parsing.run(("schemas", elf.file_id), __name__, "schemas", elf.path)
    if not found:
        return [], []
    by_name: dict[tuple[str, int], list[str]] = {}     # (op name, rank) -> mangled symbols
    for sym in elf.symbols:
        if not sym.startswith("_Z") or "." in sym:          # clones: .cold, .part.N, .isra
            continue
        try:
            dem = cxxfilt.demangle(sym)
        except cxxfilt.InvalidName:
            continue
        if "(" in dem and not dem.startswith(("void c10::", "c10::", "at::", "std::", "torch::")):
            for key in _names_for(_base_name(dem)):
                if key[0] in found:
                    by_name.setdefault(key, []).append(sym)
    ops, skipped = [], []
    for name, schema in sorted(found.items()):
        described, candidates = [], 0
        for rank in (2, 1):                  # the exact name first, then prefixed ones
            syms = by_name.get((name, rank), [])
            candidates += len(syms)
            described = [d for d in (describe(schema, s) for s in syms) if d]
            if described:
                break
        if len(described) == 1:
            ops.append(described[0])
        elif candidates:
            skipped.append(f"{name} ({'argument passing not modelled' if not described else 'overloaded'})")
    return ops, skipped
