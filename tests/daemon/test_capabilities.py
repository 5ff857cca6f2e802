"""The daemon with exactly the capabilities the DaemonSet's manifest gives it (read from the
manifest), and then with each of them taken away in turn: each one is justified by a run
without it that fails, and fails in the way WHY says.

The capability set is the daemon's bounding set (setpriv, as a container runtime sets it: the
daemon, root, gets exactly those as permitted and effective), so nothing is hidden by root.
Five llama.cpp processes wait on a FIFO for their prompt while the daemon finds them:

- host:      a root process on the host, from the build;
- user:      another user's process (uid 65534), its libraries in a directory only that user
             may search (mode 0700), as a user's home is;
- upgraded:  a root process whose libllama was deleted after it was mapped (an upgrade under a
             running server): it is reachable only through /proc/PID/map_files;
- container: a process in its own mount namespace and root (pivot_root), its own copies of
             the libraries: reached through /proc/PID/root;
- late:      another user's process in a session of its own, started after the daemon: held
             (stopped) by the daemon's discovery at its loader's hook until its probes are on,
             then continued with SIGCONT, which needs CAP_KILL for another user's process.

With every capability each counts exactly what llama.cpp reports of itself (prompt tokens and
decode calls). CAP_SYS_ADMIN is never given: uprobes are attached as uprobe-multi links
(Linux 6.6), to the file opened inside the target's root (profinfer.core.target.procfs); a perf-event
uprobe would need CAP_SYS_ADMIN since Linux 6.16 and the 2025 stable releases.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import PROMPT, completion_cmd, llama_perf, with_llama_log
from daemon_helpers import _STARTED, Daemon, _get, kill_started, manifest_caps, with_caps
from profinfer.core.ebpf import kernel

NOBODY = 65534
TOKENS = 8

# what breaks without each capability the manifest gives: the targets that are no longer
# counted, and the daemon's own words for it (a regular expression on its log)
WHY = {
    "BPF": ({"host", "user", "upgraded", "container", "late"}, r"not watched: .*Operation not permitted"),
    "PERFMON": ({"host", "user", "upgraded", "container", "late"}, r"not watched: .*Operation not permitted"),
    "SYS_PTRACE": ({"host", "user", "upgraded", "container", "late"},
                   r"not watched: .*Permission denied.*/proc/\d+/root\b"),
    "DAC_READ_SEARCH": ({"user", "late"}, r"not watched: .*Permission denied.*/proc/\d+/root/"),
    "CHECKPOINT_RESTORE": ({"upgraded"}, r"not watched: .*Operation not permitted: '/proc/\d+/map_files/"),
    # the late process, held by discovery, is never continued: it stays stopped
    "KILL": ({"late"}, r"PID (?P<pid>\d+): cannot continue it after discovery held it: Operation not permitted"),
}
TARGETS = ("host", "user", "upgraded", "container", "late")


def cap_mask(caps) -> int:
    names = {"DAC_READ_SEARCH": 2, "KILL": 5, "SYS_PTRACE": 19, "SYS_ADMIN": 21, "SYS_RESOURCE": 24,
             "PERFMON": 38, "BPF": 39, "CHECKPOINT_RESTORE": 40}
    return sum(1 << names[c] for c in caps)


pytestmark = pytest.mark.skipif(not kernel.release_at_least(6, 6),
                                reason="uprobe-multi links (Linux 6.6) are what spares CAP_SYS_ADMIN")


@pytest.fixture(autouse=True)
def _no_workload_left():
    yield
    kill_started()


def _copy_with_deps(binary: Path, dest: Path, env, loader_into: Path | None = None) -> None:
    """The binary and the build's own libraries it loads (ldd) into dest; with loader_into,
    every library (system ones too) and the dynamic loader at its own path under it."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, dest / binary.name)
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if not path.startswith("/"):
            continue
        if "ld-linux" in path:
            if loader_into is not None:
                to = loader_into / path.lstrip("/")
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, to)
        elif loader_into is not None or Path(path).parent == binary.parent:
            shutil.copy2(os.path.realpath(path), dest / os.path.basename(path))


@dataclass
class Places:
    user: Path          # 0700, owned by NOBODY: bin/, tiny.gguf
    upgraded: Path      # bin/ with libllama.so.0.keep (linked as libllama.so.0 for each run)
    container: Path     # a root: pi/bin, pi/lib, the loader, models/tiny.gguf


@pytest.fixture(scope="module")
def places(tmp_path_factory, llama_build, tiny_model, llama_env):
    base = tmp_path_factory.mktemp("caps")
    binary = llama_build / "bin" / "llama-completion"
    # the other user reaches its directory from / (pytest's own is root's alone)
    shared = Path(tempfile.mkdtemp(prefix="profinfer-caps-", dir="/tmp"))
    shared.chmod(0o755)
    user = shared / "user"
    _copy_with_deps(binary, user / "bin", llama_env)
    shutil.copy2(tiny_model, user / "tiny.gguf")
    for p in [user, *user.rglob("*")]:
        os.chown(p, NOBODY, NOBODY)
    user.chmod(0o700)
    upgraded = base / "upgraded"
    _copy_with_deps(binary, upgraded / "bin", llama_env)
    os.rename(upgraded / "bin" / "libllama.so.0", upgraded / "bin" / "libllama.so.0.keep")
    container = base / "container"
    _copy_with_deps(binary, container / "pi" / "lib", llama_env, loader_into=container)
    (container / "pi" / "bin").mkdir()
    os.rename(container / "pi" / "lib" / binary.name, container / "pi" / "bin" / binary.name)
    (container / "models").mkdir()
    (container / "tmp").mkdir()
    shutil.copy2(tiny_model, container / "models" / "tiny.gguf")
    yield Places(user, upgraded, container)
    shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(scope="module")
def truth(llama_build, tiny_model, llama_env) -> dict[str, int]:
    """What llama.cpp reports of the generation every target makes (one model, prompt and
    seed, greedy: the same tokens), from a run of its own: the copies in a user's directory and
    a container run without the drain of llama.cpp's log (conftest.llama_log_drain), whose
    last lines are then often lost under load. Each target's own report, where it has one, must say the same."""
    r = with_llama_log(lambda: subprocess.run(completion_cmd(llama_build, tiny_model, n=TOKENS), env=llama_env,
                                              capture_output=True, text=True, timeout=120))
    perf = llama_perf(r.stderr)
    return {"prefill": perf["prompt eval"][1], "decode": perf["eval"][1]}


@dataclass
class Target:
    name: str
    proc: subprocess.Popen
    fifo: Path
    perf: dict = field(default_factory=dict)

    stuck: str = ""          # why it never read its prompt (a held process never continued)

    def go(self, deadline: float, given_up=lambda: False) -> None:
        """The prompt, once it opens its FIFO (a process left stopped never does: waited for
        until the deadline, or until given_up() says the daemon gave up continuing it)."""
        while True:
            try:
                fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:          # ENXIO: no reader yet
                if time.monotonic() > deadline or given_up():
                    state = re.search(r"State:\s*(.*)", Path(f"/proc/{self.proc.pid}/status").read_text())
                    self.stuck = state.group(1) if state else "?"
                    self.proc.kill()
                    return
                time.sleep(0.05)
        with os.fdopen(fd, "w") as f:
            os.set_blocking(fd, True)
            f.write(PROMPT)

    def finish(self) -> None:
        _, err = self.proc.communicate(timeout=120)
        if self.stuck:
            return
        assert self.proc.returncode == 0, f"{self.name}: {err[-2000:]}"
        self.perf = llama_perf(err)


def _llama_args(build: Path, model: str, fifo: str) -> list[str]:
    cmd = completion_cmd(build, Path(model), n=TOKENS)[1:]
    i = cmd.index("-p")
    cmd[i:i + 2] = ["-f", fifo]
    return cmd


def _start_targets(places: Places, llama_build, tiny_model, llama_env, tmp: Path) -> dict[str, Target]:
    out = {}
    fifo = tmp / "host.fifo"
    os.mkfifo(fifo)
    out["host"] = Target("host", subprocess.Popen(
        [str(llama_build / "bin" / "llama-completion"), *_llama_args(llama_build, str(tiny_model), str(fifo))],
        env=llama_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), fifo)

    fifo = places.user / f"user-{tmp.name}.fifo"
    os.mkfifo(fifo)
    os.chown(fifo, NOBODY, NOBODY)
    out["user"] = Target("user", subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
         str(places.user / "bin" / "llama-completion"), *_llama_args(llama_build, str(places.user / "tiny.gguf"), str(fifo))],
        env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(places.user / "bin")},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/", start_new_session=True), fifo)

    lib = places.upgraded / "bin" / "libllama.so.0"
    if lib.exists():
        lib.unlink()
    os.link(places.upgraded / "bin" / "libllama.so.0.keep", lib)
    fifo = tmp / "upgraded.fifo"
    os.mkfifo(fifo)
    out["upgraded"] = Target("upgraded", subprocess.Popen(
        [str(places.upgraded / "bin" / "llama-completion"), *_llama_args(llama_build, str(tiny_model), str(fifo))],
        env={**llama_env, "LD_LIBRARY_PATH": str(places.upgraded / "bin")},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), fifo)

    root = places.container
    fifo = root / "prompt"
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    script = (f"mount --make-rprivate / && mount --bind {root} {root} && cd {root} && "
              "mkdir -p .host && pivot_root . .host && exec /pi/bin/llama-completion "
              + " ".join(_llama_args(llama_build, "/models/tiny.gguf", "/prompt")))
    out["container"] = Target("container", subprocess.Popen(
        ["unshare", "--mount", "sh", "-c", script],
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LD_LIBRARY_PATH": "/pi/lib"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), fifo)
    for t in out.values():
        _STARTED.append(t.proc)

    # each has mapped its libraries (it waits on its FIFO); then the upgrade: libllama's file
    # goes while the process runs the old one
    deadline = time.monotonic() + 30
    for t in out.values():
        pid = t.proc.pid
        while time.monotonic() < deadline:
            pid = _llama_pid(t)
            try:
                if pid and "libllama.so" in Path(f"/proc/{pid}/maps").read_text():
                    break
            except OSError:
                pass
            assert t.proc.poll() is None, t.proc.stderr.read()
            time.sleep(0.05)
    lib.unlink()
    return out


def _start_late(places: Places, llama_build, tmp: Path) -> Target:
    """Another user's process in a session of its own, started after the daemon: held by the
    daemon's discovery at its loader's hook until its probes are on, then continued."""
    fifo = places.user / f"late-{tmp.name}.fifo"
    os.mkfifo(fifo)
    os.chown(fifo, NOBODY, NOBODY)
    t = Target("late", subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
         str(places.user / "bin" / "llama-completion"),
         *_llama_args(llama_build, str(places.user / "tiny.gguf"), str(fifo))],
        env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(places.user / "bin")},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/", start_new_session=True), fifo)
    _STARTED.append(t.proc)
    return t


def _llama_pid(t: Target) -> int | None:
    """The llama.cpp process: the one started, or (container) the shell's exec of it."""
    try:
        comm = Path(f"/proc/{t.proc.pid}/comm").read_text().strip()
    except OSError:
        return None
    return t.proc.pid if comm.startswith("llama") else None


def _counted(d: Daemon, pid: int) -> dict[str, int]:
    text = _get(d.url + "/metrics")[1].decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'profinfer_tokens_total\{(.*)\} (\S+)$', line)
        if m and f'pid="{pid}"' in m.group(1):
            out[re.search(r'phase="(\w+)"', m.group(1)).group(1)] = int(float(m.group(2)))
    return out


@dataclass
class Run:
    counted: dict[str, dict[str, int]]     # per target: tokens counted by phase
    want: dict[str, dict[str, int]]        # per target: what llama.cpp reports
    log: str
    status: dict
    stuck: dict[str, str]                  # targets that never read their prompt: their state


def _run(caps, places, llama_build, tiny_model, llama_env, truth, tmp: Path,
         broken: frozenset[str] = frozenset(), said: str | None = None) -> Run:
    """Every target run through with `caps`; the waits for them to be watched and counted end
    once those that can be (all but `broken`) are: a target the daemon cannot reach is never
    waited for (its absence is checked after, and the daemon's log says why). A broken
    target's prompt waits until the daemon's log says `said` of its PID, where it names one."""
    tmp.mkdir()
    targets = _start_targets(places, llama_build, tiny_model, llama_env, tmp)
    d = Daemon(tmp, prefix=tuple(with_caps(caps)))
    try:
        eff = int(re.search(r"CapEff:\s*(\w+)", Path(f"/proc/{d.proc.pid}/status").read_text()).group(1), 16)
        assert eff == cap_mask(caps), (hex(eff), caps)
        targets["late"] = _start_late(places, llama_build, tmp)
        pids = {t.proc.pid for n, t in targets.items() if n not in broken}
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:     # every target watched, or the time is up
            status = json.loads(_get(d.url + "/status")[1])
            if pids <= {p["pid"] for p in status["processes"]}:
                break
            time.sleep(0.2)
        time.sleep(0.5)
        deadline = time.monotonic() + 8
        for n, t in targets.items():
            t.go(deadline, (lambda pid=t.proc.pid: _said_of(d.text(), said, pid)) if n in broken else lambda: False)
        for t in targets.values():
            t.finish()
        reported = {n: {"prefill": t.perf["prompt eval"][1], "decode": t.perf["eval"][1]}
                    for n, t in targets.items() if {"prompt eval", "eval"} <= t.perf.keys()}
        assert all(r == truth for r in reported.values()), (reported, truth)
        want = {n: truth for n in targets}
        counted: dict[str, dict[str, int]] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            counted = {n: _counted(d, t.proc.pid) for n, t in targets.items()}
            if all(counted[n] == w for n, w in want.items() if n not in broken):
                break
            time.sleep(0.3)
        status = json.loads(_get(d.url + "/status")[1])
        return Run(counted, want, d.text(), status, {n: t.stuck for n, t in targets.items() if t.stuck})
    finally:
        d.stop()


def _said_of(log: str, said: str | None, pid: int) -> bool:
    """The log says `said` of the PID (a pattern naming it as `pid`)."""
    if said is None or "(?P<pid>" not in said:
        return False
    return any(int(m["pid"]) == pid for m in re.finditer(said, log))


def _check_all_counted(run: Run, names) -> None:
    for n in names:
        assert run.counted[n] == run.want[n], f"{n}: counted {run.counted[n]}, llama.cpp {run.want[n]}\n{run.log}"


def test_manifest_caps_count_every_target_exactly(places, llama_build, tiny_model, llama_env, truth, tmp_path):
    caps = manifest_caps()
    assert "SYS_ADMIN" not in caps
    run = _run(caps, places, llama_build, tiny_model, llama_env, truth, tmp_path / "all")
    _check_all_counted(run, TARGETS)
    assert run.status["attach_errors"] == 0, run.log


@pytest.mark.parametrize("dropped", [c for c, why in WHY.items() if why is not None])
def test_each_capability_dropped_breaks_what_it_is_for(dropped, places, llama_build, tiny_model,
                                                       llama_env, truth, tmp_path):
    caps = manifest_caps()
    assert dropped in caps, f"{dropped} is no longer in the manifest: drop it from WHY"
    broken, said = WHY[dropped]
    run = _run([c for c in caps if c != dropped], places, llama_build, tiny_model, llama_env, truth,
               tmp_path / dropped.lower(), frozenset(broken), said)
    for n in TARGETS:
        if n in broken:
            assert not run.counted[n].get("decode"), f"{n} counted without {dropped}:\n{run.log}"
        else:
            assert run.counted[n] == run.want[n], f"{n} without {dropped}: {run.counted[n]} != {run.want[n]}\n{run.log}"
    if said:
        assert re.search(said, run.log), run.log
    # a process left stopped is the one discovery held and could not continue, and it is
    # stopped still when given up on
    assert {n: s.split()[0] for n, s in run.stuck.items()} == ({"late": "T"} if dropped == "KILL" else {}), run.stuck
    print(f"without {dropped}:", run.counted, "\n", run.log)


def test_every_manifest_capability_is_justified():
    assert set(manifest_caps()) == set(WHY)


@pytest.mark.skipif(Path("/proc/sys/kernel/bpf_stats_enabled").read_text().strip() == "1",
                    reason="the node counts BPF run time already (sysctl kernel.bpf_stats_enabled=1)")
def test_op_level_refused_where_its_cost_cannot_be_measured(tmp_path):
    """The governor measures the op level's cost from the kernel's BPF run-time counts; the
    switch for them (BPF_ENABLE_STATS) needs CAP_SYS_ADMIN, which the manifest does not give.
    Without the node's sysctl kernel.bpf_stats_enabled=1 the op level would run ungoverned:
    the daemon leaves it off and says why (with the sysctl on, test_daemon's governor test
    passes with the manifest's capabilities: PROFINFER_TEST_DAEMON_CAPS=manifest)."""
    d = Daemon(tmp_path, ("--levels", "token,op"), prefix=tuple(with_caps(manifest_caps())))
    try:
        status = json.loads(_get(d.url + "/status")[1])
        assert status["levels"] == ["token"]
        assert "op level off: BPF run-time statistics are refused" in d.text()
    finally:
        d.stop()
