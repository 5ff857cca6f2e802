"""A process confined to reading: what the parse worker does to itself before its first
reading of a tenant's file, so that a reader a crafted file subverts (a bug in a parser it
drives) can read, and little else.

- Capabilities: all dropped (effective, permitted, inheritable, ambient and the bounding set)
  but the two a reading of another process's files needs: CAP_SYS_PTRACE (to open
  /proc/PID/root of a process with more capabilities) and CAP_DAC_READ_SEARCH (to read a file
  whatever its mode). Through libcap.
- no_new_privs: nothing it could execute gains privileges.
- Landlock (Linux 5.13; ABI by version): no file written, truncated, made, removed, linked or
  executed anywhere, /proc/PID/mem of another process included; no TCP bind or connect (ABI 4).
- seccomp (libseccomp): the calls a reading never makes fail with EPERM: exec, ptrace and
  process_vm_*, signals to any process, sockets, bpf, perf_event_open, mounts and namespaces,
  modules, kexec, reboot, keys, userfaultfd, io_uring.

Each layer is applied where this kernel and machine have it; `confine()` says which were
(the daemon's /status shows it). The libraries are Debian's libcap2 and libseccomp2, which
apt itself depends on.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

KEEP_CAPS = {"cap_sys_ptrace": 19, "cap_dac_read_search": 2}     # libcap's name: the bit
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4

# Landlock: every filesystem access but reading files and directories; TCP bind and connect
LANDLOCK_CREATE_RULESET_VERSION = 1
SYS_landlock_create_ruleset, SYS_landlock_restrict_self = 444, 446    # x86-64 and arm64 alike
FS_ACCESS_BY_ABI = {1: (1 << 13) - 1 & ~(1 << 2 | 1 << 3),      # EXECUTE..MAKE_SYM, less READ_FILE, READ_DIR
                    2: (1 << 14) - 1 & ~(1 << 2 | 1 << 3),      # + REFER
                    3: (1 << 15) - 1 & ~(1 << 2 | 1 << 3),      # + TRUNCATE
                    5: (1 << 16) - 1 & ~(1 << 2 | 1 << 3)}      # + IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2

DENIED_CALLS = (
    "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev",
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal", "pidfd_open",
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "bpf", "perf_event_open", "mount", "umount2", "move_mount", "fsopen", "fsmount", "fsconfig", "fspick",
    "open_tree", "pivot_root", "chroot", "unshare", "setns",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "keyctl", "add_key", "request_key", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "capset", "setuid", "setgid", "setreuid",
    "setregid", "setresuid", "setresgid", "setgroups", "personality", "quotactl", "acct",
)
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO = 0x00050000


_LIBS: dict = {}


def _lib(name: str):
    """libNAME, found (find_library runs ldconfig: a program, temporary files) and loaded
    before any layer forbids that (confine loads both first)."""
    if name not in _LIBS:
        found = ctypes.util.find_library(name)
        if found is None:
            raise OSError(f"lib{name} not found")
        _LIBS[name] = ctypes.CDLL(found, use_errno=True)
    return _LIBS[name]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    if _libc().prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def drop_capabilities() -> str:
    cap = _lib("cap")
    cap.cap_from_text.restype = ctypes.c_void_p
    cap.cap_from_text.argtypes = [ctypes.c_char_p]
    cap.cap_set_proc.argtypes = [ctypes.c_void_p]
    cap.cap_free.argtypes = [ctypes.c_void_p]
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    with open("/proc/self/status") as f:
        permitted = next(int(line.split()[1], 16) for line in f if line.startswith("CapPrm:"))
    bounding = "bounding set dropped"
    for c in range(last + 1):
        if c not in KEEP_CAPS.values():
            try:
                _prctl(PR_CAPBSET_DROP, c)
            except OSError as e:
                if e.errno == errno.EPERM:          # no CAP_SETPCAP (a pod's least set): the rest still applies
                    bounding = "bounding set kept (no CAP_SETPCAP)"
                    break
                if e.errno != errno.EINVAL:         # EINVAL: a capability this kernel does not know
                    raise
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    keep = [name for name, bit in KEEP_CAPS.items() if permitted >> bit & 1]
    caps = cap.cap_from_text((",".join(keep) + "=ep").encode() if keep else b"=")
    if not caps:
        raise OSError(ctypes.get_errno(), "cap_from_text")
    try:
        if cap.cap_set_proc(caps) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    finally:
        cap.cap_free(caps)
    return f"{'+'.join(keep) or 'none'} kept, {bounding}"


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


def landlock() -> str:
    syscall = _libc().syscall
    syscall.restype = ctypes.c_long
    abi = syscall(SYS_landlock_create_ruleset, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        raise OSError(ctypes.get_errno(), "Landlock is not enabled in this kernel")
    fs = FS_ACCESS_BY_ABI[max(v for v in FS_ACCESS_BY_ABI if v <= abi)]
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0)
    size = ctypes.sizeof(attr) if abi >= 4 else 8
    fd = syscall(SYS_landlock_create_ruleset, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    try:
        if syscall(SYS_landlock_restrict_self, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    finally:
        os.close(fd)
    return f"ABI {abi}"


def seccomp() -> str:
    lib = _lib("seccomp")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        n = 0
        for name in DENIED_CALLS:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:                  # not a call of this architecture
                continue
            rc = lib.seccomp_rule_add(ctx, SCMP_ACT_ERRNO | errno.EPERM, nr, 0)
            if rc != 0:
                raise OSError(-rc, f"seccomp_rule_add({name})")
            n += 1
        rc = lib.seccomp_load(ctx)
        if rc != 0:
            raise OSError(-rc, "seccomp_load")
    finally:
        lib.seccomp_release(ctx)
    return f"{n} calls denied"


def confine() -> dict[str, str]:
    """Each layer applied, in order (capabilities while capset is allowed, no_new_privs
    before Landlock and seccomp, which need it): its name -> what it did, or why not."""
    out = {}
    for lib in ("cap", "seccomp"):
        try:
            _lib(lib)
        except OSError:
            pass                # its layer says so
    for name, layer in (("capabilities", drop_capabilities), ("no_new_privs", lambda: _prctl(PR_SET_NO_NEW_PRIVS, 1) or "set"),
                        ("landlock", landlock), ("seccomp", seccomp)):
        try:
            out[name] = layer()
        except (OSError, AttributeError) as e:
            out[name] = f"not applied: {e}"
    return out
