"""llama-server's request marks (pack.toml: request_posted, request_launched): the offsets
their programs read, from the server library's DWARF, as the op level reads ggml_tensor's.

Without DWARF for server_task and server_slot the marks are not read (no table of offsets:
server_task is a large C++ struct that changes often); the collector says so in one line.
The tasks' types are named by the enum server_task_type as the launch's compile unit
defines it (without it, by b11434's order: decode/requests.py)."""
from __future__ import annotations

from profinfer.core.target import dwarf

REQUEST_PROGRAMS = ("request_posted", "request_launched")
TYPE_PREFIX = "SERVER_TASK_TYPE_"


def request_offsets(elf) -> tuple[dict[str, int] | None, str]:
    """The config's task_* and slot_off_id for the library `elf` (its probes' file), or
    (None, why not)."""
    if not elf.dwarf_path:
        return None, f"no DWARF in {elf.path}: llama-server's requests are not read (build it with -g)"
    task = dwarf.struct_layout(elf.dwarf_path, "server_task")
    slot = dwarf.struct_layout(elf.dwarf_path, "server_slot")
    needed = (task and task["size"] and {"id", "type", "id_parent"} <= task["members"].keys()
              and slot and "id" in slot["members"])
    if not needed:
        return None, (f"no server_task/server_slot layout in {elf.path}'s DWARF: "
                      "llama-server's requests are not read")
    m = task["members"]
    return {"task_size": task["size"], "task_off_id": m["id"], "task_off_type": m["type"],
            "task_off_parent": m["id_parent"], "slot_off_id": slot["members"]["id"]}, ""


def task_types(probe) -> dict[int, str]:
    """server_task_type's values by name ("completion", ...), from the DWARF of the unit
    that defines the probed function ({} where not found)."""
    facts = dwarf.function_facts(probe.elf.dwarf_path, probe.symbol.vaddr, (), TYPE_PREFIX)
    return {v: k.removeprefix(TYPE_PREFIX).lower() for k, v in (facts or {}).get("enums", {}).items()}


def fill(probes: list, cfg, warnings: list[str]) -> tuple[list, dict[int, str]]:
    """Offsets for the request probes in `cfg`; the probes kept (where the offsets cannot be
    read, the request probes go and `warnings` says why) and the task types' names."""
    ours = [p for p in probes if p.entry_fn in REQUEST_PROGRAMS]
    if not ours:
        return probes, {}
    offsets, why = request_offsets(ours[0].elf)
    if offsets is None:
        warnings.append(why)
        return [p for p in probes if p not in ours], {}
    for key, value in offsets.items():
        cfg[key] = value
    return probes, task_types(ours[-1])
