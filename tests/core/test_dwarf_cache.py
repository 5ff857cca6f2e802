"""The DWARF layout cache is shared by every process on a node: a tenant's library that claims
another library's build id, with another layout, must not decide the other's layout. Truth:
offsetof() in a program compiled with each library's own struct."""
from __future__ import annotations

import subprocess

from profinfer.core.target import dwarf

BUILD_ID = "0x" + "ab" * 20
STRUCTS = {
    "real": "struct ggml_tensor { int type; long ne[4]; int op; void *src[10]; char name[64]; };",
    "forged": "struct ggml_tensor { char name[64]; void *src[10]; int op; long ne[4]; int type; };",
}
MEMBERS = ("type", "ne", "op", "src", "name")


def _build(tmp_path, kind: str) -> tuple[str, dict[str, int]]:
    src = tmp_path / f"{kind}.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n" + STRUCTS[kind] + "\n"
                   "struct ggml_tensor *ggml_new(struct ggml_tensor *t) { return t; }\n"
                   "#ifdef MAIN\nint main(void) {\n"
                   + "".join(f'printf("{m} %zu\\n", offsetof(struct ggml_tensor, {m}));\n' for m in MEMBERS)
                   + "return 0; }\n#endif\n")
    lib = tmp_path / kind / "libggml-base.so"
    lib.parent.mkdir()
    subprocess.run(["cc", "-g", "-shared", "-fPIC", f"-Wl,--build-id={BUILD_ID}", "-o", str(lib), str(src)],
                   check=True)
    exe = tmp_path / f"{kind}-offsets"
    subprocess.run(["cc", "-DMAIN", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return str(lib), {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_a_forged_build_id_does_not_decide_another_files_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("PROFINFER_CACHE", str(tmp_path / "cache"))
    forged, forged_truth = _build(tmp_path, "forged")
    real, real_truth = _build(tmp_path, "real")
    assert forged_truth != real_truth
    first = dwarf.struct_layout(forged, "ggml_tensor")       # the tenant's, read (and cached) first
    assert {m: first["members"][m] for m in MEMBERS} == forged_truth
    found = dwarf.struct_layout(real, "ggml_tensor")
    assert {m: found["members"][m] for m in MEMBERS} == real_truth
    again = dwarf.struct_layout(real, "ggml_tensor")         # from the cache now
    assert again == found
    assert len(list((tmp_path / "cache" / "layouts").iterdir())) == 2
