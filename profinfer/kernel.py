"""What the running kernel offers BPF: privileges, headers for BCC, tracefs, uprobe PMU."""
from __future__ import annotations

import glob
import os
import platform
import re
import shutil

from .errors import NotRootError, ProfinferError

UPROBE_PMU = "/sys/bus/event_source/devices/uprobe/type"


def require_root() -> None:
    if os.geteuid() != 0:
        raise NotRootError("profinfer needs root (CAP_BPF and CAP_PERFMON) to attach probes; "
                           "run it with sudo")


def kernel_headers() -> tuple[str | None, str]:
    """(directory BCC should use or None for its default, a description of the choice)."""
    release = platform.release()
    own = f"/lib/modules/{release}/build"
    if os.path.isdir(own):
        return None, f"headers for {release} at {own}"
    if os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return None, "headers from the kernel's kheaders module"
    # Uprobe programs use only stable uapi/ptrace definitions, so a header tree of another
    # release compiles them correctly.
    trees = sorted(glob.glob("/usr/src/linux-headers-*-amd64") + glob.glob("/usr/src/linux-headers-*-arm64"))
    if trees:
        tree = _merged_tree(trees[-1])
        return tree, f"no headers for {release}; using {trees[-1]} (fine for uprobe programs)"
    raise ProfinferError(f"no kernel headers for {release} and no fallback tree in /usr/src: "
                         "install linux-headers-$(uname -r), or linux-headers-amd64")


def _merged_tree(arch_tree: str) -> str:
    """Debian splits a header tree into -<arch> (generated files) and -common (the rest).

    BCC expects one tree, so build (once, cached) a tree of symlinks merging both.
    """
    common = re.sub(r"-(amd64|arm64)$", "-common", arch_tree)
    if not os.path.isdir(common):
        return arch_tree
    cache = os.environ.get("PROFINFER_CACHE") or os.path.expanduser("~/.cache/profinfer")
    merged = os.path.join(cache, "kernel-headers", os.path.basename(arch_tree))
    if not os.path.exists(os.path.join(merged, ".complete")):
        shutil.rmtree(merged, ignore_errors=True)
        _merge_dirs(merged, [arch_tree, common])
        open(os.path.join(merged, ".complete"), "w").close()
    return merged


def _merge_dirs(dst: str, srcs: list[str]) -> None:
    os.makedirs(dst, exist_ok=True)
    names: dict[str, list[str]] = {}
    for src in srcs:
        for name in os.listdir(src):
            names.setdefault(name, []).append(os.path.join(src, name))
    for name, paths in names.items():
        dirs = [p for p in paths if os.path.isdir(p)]
        if len(dirs) > 1:
            _merge_dirs(os.path.join(dst, name), dirs)
        else:
            os.symlink(os.path.realpath(paths[0]), os.path.join(dst, name))


def prepare_bcc_environment() -> str:
    """Point BCC at usable headers before it compiles anything; returns a description."""
    tree, what = kernel_headers()
    if tree and "BCC_KERNEL_SOURCE" not in os.environ:
        os.environ["BCC_KERNEL_SOURCE"] = tree
    return what


def tracefs_mounted() -> bool:
    for mnt in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.exists(os.path.join(mnt, "uprobe_events")):
            return True
    return False


def uprobe_pmu() -> bool:
    """perf_event_open can create uprobes itself: no tracefs, and they vanish with our fds."""
    return os.path.exists(UPROBE_PMU)


def ring_buffer_supported() -> bool:
    """BPF ring buffers arrived in Linux 5.8."""
    nums = re.match(r"(\d+)\.(\d+)", platform.release())
    return bool(nums) and (int(nums.group(1)), int(nums.group(2))) >= (5, 8)


def event_buffer_kind(choice: str) -> str:
    """"ring" or "perf" for --buffer auto|ring|perf."""
    if choice == "auto":
        return "ring" if ring_buffer_supported() else "perf"
    if choice == "ring" and not ring_buffer_supported():
        raise ProfinferError(f"kernel {platform.release()} has no BPF ring buffer (5.8+): use --buffer perf")
    return choice


def import_bcc():
    try:
        import bcc  # Debian's python3-bpfcc; never the unrelated PyPI package named bcc
    except ImportError:
        raise ProfinferError("BCC's Python module is missing: apt-get install python3-bpfcc "
                             "(and use a venv made with --system-site-packages)") from None
    if not hasattr(bcc, "BPF"):
        raise ProfinferError(f"the 'bcc' module at {bcc.__file__} is not BCC "
                             "(the PyPI package named bcc is unrelated): pip uninstall bcc")
    return bcc
