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
from elftools.elf.elffile import ELFFile

from ...symbols import ElfInfo

# the BPF side's argument kinds (bpf/vllm.h)
SKIP, TENSOR, OPT_TENSOR, STABLE_TENSOR = 0, 1, 2, 3
MAX_ARGS = 24
N_INT_REGS = 6

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
    kinds: tuple[int, ...]        # per C++ parameter: SKIP / TENSOR / OPT_TENSOR / STABLE_TENSOR
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
    """Every op schema string in the library's read-only data, by op name."""
    found: dict[str, Schema] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for sec in elf.iter_sections():
            if sec.name not in (".rodata", ".data.rel.ro") and not sec.name.startswith(".rodata."):
                continue
            for m in _SCHEMA.finditer(sec.data()):
                name, args, ret = (g.decode("latin-1") for g in m.groups())
                found.setdefault(name, parse_schema(name, args, ret))
    return found


# How a C++ parameter type is passed: (kind for BPF, integer slots it takes; 0: a vector
# register). None: a type whose passing is not modelled (the op is not probed).
def _passing(cxx: str) -> tuple[int, int] | None:
    t = cxx.replace("const", "").replace(" ", "")
    by_ref = t.endswith("&")
    t = t.rstrip("&")
    if t in ("at::Tensor",):
        return TENSOR, 1                 # by value too: non-trivial, passed by invisible reference
    if t == "std::optional<at::Tensor>":
        return OPT_TENSOR, 1
    if t.startswith("torch::stable::Tensor") or t == "torch::headeronly::stable::Tensor":
        return (STABLE_TENSOR, 1) if by_ref or True else None
    if by_ref:
        return SKIP, 1                   # any other reference: a pointer
    if t in ("double", "float"):
        return SKIP, 0
    if t in ("long", "int", "bool", "unsignedlong", "unsignedint", "c10::ScalarType", "char",
             "longlong", "unsignedchar", "short", "signedchar", "std::optional<c10::ScalarType>",
             "std::optional<bool>") or t.endswith("*"):
        return SKIP, 1
    if t in ("c10::SymInt",) or t.startswith(("std::__cxx11::basic_string", "std::basic_string",
                                              "std::vector<", "c10::List<", "std::optional<at::Tensor")):
        return SKIP, 1                   # non-trivial: by invisible reference
    if t.startswith(("c10::ArrayRef<", "std::optional<long>", "std::optional<double>")):
        return None                      # two eightbytes, or integer and vector: not modelled
    return None


def _params(signature: str) -> list[str] | None:
    m = re.match(r"^[^(]*\((.*)\)\s*$", signature)
    if not m:
        return None
    inner = m.group(1).strip()
    return [] if inner in ("", "void") else _split_top(inner)


def describe(schema: Schema, symbol: str) -> NativeOp | None:
    """The op's argument passing, from its C++ signature; None where it is not modelled."""
    try:
        signature = cxxfilt.demangle(symbol)
    except cxxfilt.InvalidName:
        return None
    params = _params(signature)
    if params is None or len(params) != len(schema.args) or len(params) > MAX_ARGS:
        return None
    reg = 1 if schema.returns_in_memory else 0
    stack = 0
    kinds, slots = [], []
    for p in params:
        passing = _passing(p)
        if passing is None:
            return None
        kind, n = passing
        if n == 0:
            kinds.append(SKIP)
            slots.append(0)
            continue
        if reg < N_INT_REGS:
            slots.append(reg)
            reg += 1
        else:
            slots.append(N_INT_REGS + stack)
            stack += 1
        kinds.append(kind)
    if any(k != SKIP and not schema.args[i].is_tensor for i, k in enumerate(kinds)):
        return None                      # the C++ and schema disagree: not this op's function
    return NativeOp(schema.name, schema, symbol, signature, tuple(kinds), tuple(slots))


def _base_name(demangled: str) -> str:
    head = demangled.split("(", 1)[0]
    return head.rsplit("::", 1)[-1]


def native_ops(elf: ElfInfo) -> tuple[list[NativeOp], list[str]]:
    """The library's ops that can be probed, and the names of those that cannot (why)."""
    found = schemas(elf.path)
    if not found:
        return [], []
    by_name: dict[str, list[str]] = {}
    for sym in elf.symbols:
        if not sym.startswith("_Z"):
            continue
        try:
            dem = cxxfilt.demangle(sym)
        except cxxfilt.InvalidName:
            continue
        if "(" not in dem:
            continue
        base = _base_name(dem)
        if base in found:
            by_name.setdefault(base, []).append(sym)
    ops, skipped = [], []
    for name, schema in sorted(found.items()):
        candidates = by_name.get(name, [])
        described = [d for d in (describe(schema, s) for s in candidates) if d]
        if len(described) == 1:
            ops.append(described[0])
        elif candidates:
            skipped.append(f"{name} ({'argument passing not modelled' if not described else 'overloaded'})")
    return ops, skipped
