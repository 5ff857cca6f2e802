"""Discovery on real processes: libraries deleted and replaced on disk after the target
mapped them (an upgrade under a running server) are still probed, through
/proc/PID/map_files, in the code that actually runs."""
from __future__ import annotations

import shutil

from conftest import Target, endless_cmd, run_profinfer
from profinfer.core.target import process


def test_deleted_and_replaced_library(llama_build, tiny_model, llama_env, tmp_path, bpf_watch):
    copy = tmp_path / "bin"
    shutil.copytree(llama_build / "bin", copy, symlinks=True)
    cmd = endless_cmd(llama_build, tiny_model)
    cmd[0] = str(copy / "llama-completion")
    # LD_LIBRARY_PATH outranks the binary's RUNPATH, so the copies are what gets mapped.
    env = {**llama_env, "LD_LIBRARY_PATH": str(copy)}
    target = Target(cmd, env)
    try:
        cpu = next(p for p in copy.glob("libggml-cpu.so.*.*"))
        cpu.unlink()
        shutil.copy(copy / "llama-completion", cpu)       # another file under the same name
        mapped = {m.path: m for m in process.mapped_files(target.proc.pid)}
        assert mapped[str(cpu)].deleted and "/map_files/" in mapped[str(cpu)].host_path

        r = run_profinfer(["attach", "--pid", str(target.proc.pid), "--duration", "2", "--quiet"],
                          tmp_path=tmp_path)
        assert r.rc == 0, r.stderr
        assert r.summary["tokens"]["decode"] > 0
        assert any(o["op"] == "MUL_MAT" and o["count"] > 0 for o in r.summary["ops"])
        assert bpf_watch.leftovers({target.proc.pid}) == []
        assert target.still_generating()
    finally:
        target.stop()
