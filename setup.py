"""The wheel carries profinfer's BPF objects, both variants of every program, compiled by clang
when the wheel is built (so building it needs clang and libbpf-dev; installing and running it
needs neither, nor kernel headers: libbpf1 alone). They are compiled by the code that compiles
them at run time (profinfer/core/ebpf/bpfbuild.py, loaded by its path: the build has none of
profinfer's dependencies) into profinfer/core/ebpf/prebuilt/ of the wheel. Everything else is
in pyproject.toml. An editable install ships none: a checkout builds them into its cache."""
from __future__ import annotations

import importlib.util
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _bpfbuild():
    path = os.path.join(HERE, "profinfer", "core", "ebpf", "bpfbuild.py")
    spec = importlib.util.spec_from_file_location("profinfer_bpfbuild", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithBpf(build_py):
    """build_py, then the BPF objects compiled into the build's package folder."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        bpfbuild = _bpfbuild()
        why = bpfbuild.missing_tools(bpfbuild.find_clang())
        if why:
            raise SystemExit(f"profinfer: building the wheel compiles its BPF objects and {why}")
        shutil.rmtree(self._out_dir(), ignore_errors=True)      # an earlier build's, in build/
        try:
            names = bpfbuild.build_all(self._bpf_dirs(), self._out_dir())
        except bpfbuild.BuildError as e:
            raise SystemExit(f"profinfer: building the wheel's BPF objects: {e}") from None
        self._built = [*names, bpfbuild.MANIFEST]

    def _out_dir(self) -> str:
        return os.path.join(self.build_lib, "profinfer", "core", "ebpf", "prebuilt")

    def _bpf_dirs(self) -> list[str]:
        """The core's bpf/ first, then each plugin's of this distribution (its entry points,
        by name), as copied into the build: the folders registry.bpf_dirs() gives when this
        wheel is installed."""
        plugins = self.distribution.entry_points.get("profinfer.plugins", [])
        modules = sorted((line.split("=", 1)[0].strip(), line.split("=", 1)[1].split(":")[0].strip())
                         for line in plugins)
        dirs = [os.path.join(self.build_lib, "profinfer", "core", "ebpf", "bpf")]
        for _, module in modules:
            d = os.path.join(self.build_lib, *module.split("."), "bpf")
            if os.path.isdir(d):
                dirs.append(d)
        return dirs

    def get_outputs(self, include_bytecode=1):
        out = super().get_outputs(include_bytecode)
        return out + [os.path.join(self._out_dir(), n) for n in getattr(self, "_built", [])]


setup(cmdclass={"build_py": BuildPyWithBpf})
