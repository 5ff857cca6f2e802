"""Profiling works without headers for the running kernel and without tracefs.

The BPF object is compiled ahead of time, so attaching needs neither kernel headers (of any
release) nor a compiler, and the uprobe levels need no kernel BTF either. All of that is hidden in a private mount namespace, so the test
means the same on a machine that has them, and the host is left untouched.
"""
from __future__ import annotations

import platform
import shlex
import subprocess

from conftest import PROFINFER, completion_cmd, llama_perf, with_llama_log


def test_no_headers_for_running_kernel_and_no_tracefs(llama_build, tiny_model, llama_env, tmp_path):
    out = tmp_path / "s.json"
    inner = " ".join(shlex.quote(a) for a in [*PROFINFER, "record", "--quiet", "--json", str(out), "--",
                                              *completion_cmd(llama_build, tiny_model, n=16)])
    script = f"""
        set -e
        # no /lib/modules/$(uname -r)/build, no header tree of any release (hidden where present)
        for d in /lib/modules /usr/src; do if [ -d $d ]; then mount -t tmpfs none $d; fi; done
        for d in /usr/lib/llvm-*; do mount -t tmpfs none $d; done   # no clang
        mount -t tmpfs none /sys/kernel/btf         # no kernel BTF: uprobe levels need none
        ! command -v clang-14 >/dev/null || ! clang-14 --version >/dev/null 2>&1
        for t in /sys/kernel/tracing /sys/kernel/debug/tracing; do
            if mountpoint -q $t; then umount $t; fi
        done
        test ! -e /lib/modules/{platform.release()}/build
        test ! -e /sys/kernel/tracing/uprobe_events
        COLUMNS=250 {PROFINFER[0]} -m profinfer.cli doctor --no-workloads | grep -q 'programs load and verify'
        exec {inner}
    """
    p = with_llama_log(lambda: subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
        capture_output=True, text=True, env=llama_env, timeout=300))
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    s = json.loads(out.read_text())
    assert s["tokens"]["decode"] == llama_perf(p.stderr)["eval"][1]
    assert any(o["op"] == "MUL_MAT" for o in s["ops"])


def test_sched_level_without_kernel_btf_is_one_clear_error(llama_build, tiny_model, llama_env, tmp_path):
    """Without kernel BTF the sched level cannot relocate task_struct: it says so, in one line."""
    inner = " ".join(shlex.quote(a) for a in [*PROFINFER, "record", "--quiet", "--levels", "token,sched",
                                              "--", *completion_cmd(llama_build, tiny_model, n=4)])
    script = f"""
        set -e
        mount -t tmpfs none /sys/kernel/btf
        test ! -e /sys/kernel/btf/vmlinux
        exec {inner}
    """
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                       capture_output=True, text=True, env=llama_env, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    errors = [l for l in p.stderr.splitlines() if l.startswith("profinfer: error: ")]
    assert len(errors) == 1 and "kernel BTF" in errors[0], p.stderr[-2000:]
