"""`record` follows what its command becomes: an exec'd image (`env`), a shell script's child,
and a Python program that loads libllama with dlopen (ctypes, as llama-cpp-python does) in a
forked child. Every llama_decode is counted, against llama.cpp's own report."""
from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import completion_cmd, llama_perf, run_profinfer, with_llama_log


def assert_counts_match_llama(r) -> None:
    assert r.rc == 0, r.stderr
    perf = llama_perf(r.stderr)
    s = r.summary
    assert perf["eval"][1] > 0, "the run generated nothing: the comparison would say nothing"
    assert s["tokens"]["prefill"] == perf["prompt eval"][1]
    assert s["tokens"]["decode"] == perf["eval"][1]
    assert s["lost_events"] == 0
    assert {o["op"] for o in s["ops"]} >= {"MUL_MAT", "ROPE"}


def test_record_through_env(llama_build, tiny_model, llama_env, tmp_path):
    cmd = ["env", "PROFINFER_FOLLOW_TEST=1", *completion_cmd(llama_build, tiny_model, n=16)]
    r = with_llama_log(lambda: run_profinfer(["record", "--quiet", "--", *cmd], env=llama_env,
                                             tmp_path=tmp_path))
    assert_counts_match_llama(r)


def test_record_through_shell_script(llama_build, tiny_model, llama_env, tmp_path):
    """The engine runs as the script's child (fork, then exec), between two other commands."""
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\nls / >/dev/null\n"
                      f"{shlex.join(completion_cmd(llama_build, tiny_model, n=16))}\n"
                      "status=$?\necho finished >&2\nexit $status\n")
    script.chmod(0o755)
    r = with_llama_log(lambda: run_profinfer(["record", "--quiet", "--", str(script)],
                                             env=llama_env, tmp_path=tmp_path))
    assert_counts_match_llama(r)
    assert int(r.summary["meta"]["processes_followed"]) >= 3   # sh, ls, llama-completion


@pytest.fixture(scope="module")
def simple_library(llama_build, tmp_path_factory) -> Path:
    """llama.cpp's own llama-simple example built as a shared library (`run_simple`), for a
    Python program to load with ctypes: libllama then arrives by dlopen."""
    src = Path(llama_build).parent / "src"
    out = tmp_path_factory.mktemp("simple") / "libsimple.so"
    wrapper = out.with_name("simple_lib.cpp")
    wrapper.write_text(f'#define main simple_main\n#include "{src}/examples/simple/simple.cpp"\n'
                       '#undef main\nextern "C" int run_simple(int argc, char **argv) '
                       '{ return simple_main(argc, argv); }\n')
    bin_dir = Path(llama_build) / "bin"
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", str(wrapper), f"-I{src / 'include'}",
                    f"-I{src / 'ggml/include'}", f"-L{bin_dir}", "-lllama", f"-Wl,-rpath,{bin_dir}",
                    "-o", str(out)], check=True)
    return out


def test_record_python_dlopen_in_child(llama_build, tiny_model, llama_env, tmp_path, simple_library):
    """Python forks; the child dlopens libllama (never mapped before the fork) and decodes."""
    program = tmp_path / "app.py"
    libllama = Path(llama_build) / "bin" / "libllama.so"
    program.write_text(textwrap.dedent(f"""
        import ctypes, os, sys
        pid = os.fork()
        if pid == 0:
            ctypes.CDLL({str(libllama)!r}, mode=ctypes.RTLD_GLOBAL)
            simple = ctypes.CDLL({str(simple_library)!r})
            argv = [b"simple", b"-m", {str(tiny_model).encode()!r}, b"-n", b"16", b"Once upon a time"]
            rc = simple.run_simple(len(argv), (ctypes.c_char_p * len(argv))(*argv))
            os._exit(rc)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """))
    r = run_profinfer(["record", "--quiet", "--", sys.executable, str(program)], env=llama_env,
                      tmp_path=tmp_path)
    assert_counts_match_llama(r)
    assert r.summary["meta"]["processes_followed"] == "2"


def test_record_of_no_engine_says_so(tmp_path):
    r = run_profinfer(["record", "--", "sh", "-c", "true"], tmp_path=tmp_path)
    assert r.rc != 0 and "Traceback" not in r.stderr
    assert "no known engine in process" in r.stderr
