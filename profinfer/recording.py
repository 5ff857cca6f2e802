"""`record`'s work: a command started held before its exec, followed by a profiling session
from its first instruction (profinfer.core.follow), then let run; the profile stamped with
this machine's calibration. The CLI's `record` and `demo` call it."""
from __future__ import annotations

import os
import shutil
import signal

from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import Profile
from profinfer import say


def record_command(command: list[str], levels: set[str], duration: float | None,
                   tensor_layout: str | None = None, env: dict[str, str] | None = None,
                   buffer: str = "auto", counters: list[str] | None = None,
                   packs: tuple[str, ...] = (), timeline: bool = True,
                   warn=say.warn, note=say.note) -> tuple[Profile, int]:
    """Start `command` held before exec, follow it, then let it run. Returns (profile, exit
    code: negative for a signal, as subprocess gives it); warn and note take the session's
    lines for the user."""
    from profinfer.core.calibration import stamped
    from profinfer.core.session import profile_process
    exe = shutil.which(command[0], path=(env or os.environ).get("PATH"))
    if not exe:
        raise ProfinferError(f"command not found: {command[0]}")
    from profinfer.core.ebpf.kernel import require_root
    require_root()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: wait until the probes are in, then become the command
        os.close(go_w)
        if os.read(go_r, 1) != b"g":
            os._exit(125)
        try:
            os.execve(exe, command, env if env is not None else os.environ)
        except OSError as e:
            os.write(2, f"profinfer: cannot run {exe}: {e.strerror}\n".encode())
            os._exit(127)
    os.close(go_r)
    released = []

    def release():
        os.write(go_w, b"g")
        os.close(go_w)
        released.append(True)

    status: list[int] = []
    try:
        profile = profile_process(pid, levels, duration, child_status=status, follow=True,
                                  on_attached=release, tensor_layout=tensor_layout, buffer=buffer,
                                  counters=counters, extra_packs=packs, timeline=timeline,
                                  warn=warn, note=note)
    finally:
        if not released:
            os.close(go_w)  # the child reads EOF and exits without running the command
        if not status:  # stopped before the command ended: it does not outlive its profiler
            try:
                os.kill(pid, signal.SIGTERM)
                _, st = os.waitpid(pid, 0)
                status.append(os.waitstatus_to_exitcode(st))
            except ChildProcessError:
                pass
    stamped.stamp(profile)     # the roofs and trap costs that judge this run
    return profile, (status[0] if status else 0)


def shell_status(code: int) -> int:
    """An exit code as a shell reports it: 128+N for a process killed by signal N."""
    return 128 - code if code < 0 else code


def how_it_ended(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name} (status {shell_status(code)})"
