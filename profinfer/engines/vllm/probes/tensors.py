"""c10::TensorImpl's layout in the target's torch, and its check on live tensors.

Torch wheels carry no debug info, so the offsets come from a table of the layouts known
(measured with offsetof on each release's headers, x86-64); the torch release is read from
the package beside the libtorch the target maps. A table layout is trusted only once the
first tensors read with it are consistent (numel equal to the product of the sizes, a known
dtype), as the ggml layout is.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from profinfer.core.target import procfs
from profinfer.core.base.errors import ProfinferError


@dataclass(frozen=True)
class TensorLayout:
    name: str
    storage: int          # c10::Storage (intrusive_ptr<StorageImpl>)
    storage_data: int     # StorageImpl's data pointer
    sizes: int            # SizesAndStrides (size_ first, then inline sizes or a pointer)
    storage_offset: int
    numel: int
    dtype: int            # data_type_ (caffe2::TypeMeta: a u16 index = ScalarType)


_LAYOUT_184 = TensorLayout("torch 2.4-2.10", 16, 16, 64, 152, 160, 168)
_LAYOUT_176 = TensorLayout("torch 2.11-2.14", 16, 16, 56, 144, 152, 160)
# (first release, last release) -> layout
KNOWN = (((2, 4), (2, 10), _LAYOUT_184), ((2, 11), (2, 14), _LAYOUT_176))
ANY_RELEASE = "2.13"     # for ops that read no tensor (a pack's declared functions)

# c10::ScalarType, as torch.profiler and users name them
DTYPES = {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32",
          7: "float64", 8: "complex32", 9: "complex64", 10: "complex128", 11: "bool",
          12: "qint8", 13: "quint8", 14: "qint32", 15: "bfloat16", 23: "float8_e5m2",
          24: "float8_e4m3fn"}
MAX_SCALAR_TYPE = 64


def torch_version(mapped_paths: list[str], root: str = "/") -> str | None:
    """The torch release of the libtorch among the target's mapped files."""
    for path in mapped_paths:
        if os.path.basename(path).startswith("libtorch_cpu.so") or os.path.basename(path) == "libc10.so":
            pkg = os.path.dirname(os.path.dirname(path))        # .../torch/lib/x -> .../torch
            try:       # procfs: inside the target's root, a regular file, not waited on
                with procfs.open_binary(os.path.join(root, pkg.lstrip("/"), "version.py")) as f:
                    m = re.search(r"__version__\s*=\s*'([^']+)'", f.read(1 << 16).decode("utf-8", "replace"))
            except OSError:
                continue
            if m:
                return m.group(1)
    return None


def layout_for(version: str | None, forced: str | None = None) -> TensorLayout:
    if forced:
        for _, _, lay in KNOWN:
            if lay.name == forced:
                return lay
        raise ProfinferError(f"unknown TensorImpl layout {forced!r}; known: "
                             + ", ".join(l.name for _, _, l in KNOWN))
    if version is None:
        raise ProfinferError("the target maps no libtorch whose release can be read: "
                             "the TensorImpl layout is unknown")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m:
        v = (int(m.group(1)), int(m.group(2)))
        for first, last, lay in KNOWN:
            if first <= v <= last:
                return lay
    raise ProfinferError(f"torch {version}: its TensorImpl layout is not in profinfer's table "
                         f"({', '.join(l.name for _, _, l in KNOWN)})")


def consistent(ndim: int, numel: int, sizes, dtype: int) -> bool:
    """A tensor read with the layout looks like a tensor: what a wrong offset breaks."""
    if ndim == 0xff:
        return True                       # an empty optional: nothing was read
    if not 0 <= ndim <= 16 or not 0 <= dtype < MAX_SCALAR_TYPE or dtype not in DTYPES:
        return False
    if ndim > len(sizes):
        return numel >= 0
    product = 1
    for s in sizes[:ndim]:
        if s < 0:
            return False
        product *= int(s)
    return product == numel
