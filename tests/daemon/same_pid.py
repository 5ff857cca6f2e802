"""Run a command whose pid is the same in this PID namespace and in its parent's (clone3 with
set_tid: CAP_CHECKPOINT_RESTORE over both), and wait for it; print its pid first.

    python3 same_pid.py PARENT_PID_MAX COMMAND [ARG...]

For test_systemd.py: systemd boots only as PID 1 of a PID namespace of its own, but the
daemon's BPF programs name processes by their pids in the host's namespace, as they are on a
host where the unit runs. A workload with one pid in both is watched as it would be there.
PARENT_PID_MAX: the parent namespace's pid_max (this one's may be larger)."""
import ctypes
import os
import random
import struct
import sys

SYS_CLONE3 = 435
SIGCHLD = 17
EEXIST = 17


def main() -> int:
    ceiling = min(int(sys.argv[1]), int(open("/proc/sys/kernel/pid_max").read()))
    command = sys.argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(1000):
        want = random.randrange(max(300, ceiling // 2), ceiling)
        tids = (ctypes.c_int32 * 2)(want, want)          # innermost namespace first
        # struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal, stack,
        # stack_size, tls, set_tid, set_tid_size, cgroup
        args = ctypes.create_string_buffer(struct.pack("11Q", 0, 0, 0, 0, SIGCHLD, 0, 0, 0,
                                                       ctypes.addressof(tids), 2, 0), 88)
        pid = libc.syscall(SYS_CLONE3, args, 88)
        if pid == 0:
            try:
                os.execvp(command[0], command)
            finally:
                os._exit(127)
        if pid > 0:
            break
        if ctypes.get_errno() != EEXIST:        # EEXIST: taken in one of the namespaces
            print(f"clone3: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            return 1
    else:
        print("clone3: no pid free in both namespaces", file=sys.stderr)
        return 1
    print(f"pid {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
