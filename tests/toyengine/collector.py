"""The toy engine's collector: toy_decode calls as token calls, toy_op calls as ops."""
from __future__ import annotations

import ctypes
import os
import platform
import time

import numpy as np

from profinfer.core import bpfobj, discovery, kernel, layout, libbpf
from profinfer.core.errors import ProfinferError
from profinfer.core.model import OpSlice, Profile, TokenCall
from profinfer.core.packs import Pack, copies_of_probed, engine_libraries, resolve
from profinfer.core.transport import EventTransport, attach_failed

HEADER = "toyengine.h"
PERF_PAGES_PER_CPU, PERF_WAKEUP_EVENTS = 16, 16


class ToyCollector:
    def __init__(self, pid: int, levels: set[str], pack: Pack, lib_paths: list[tuple[str, str]],
                 root: str = "/", ringbuf_pages: int = 256, buffer: str = "auto",
                 followed_map_fd: int | None = None, **_options):
        self.pid, self.levels, self.pack, self.lib_paths, self.root = pid, set(levels), pack, lib_paths, root
        self.ringbuf_pages = ringbuf_pages
        self.buffer = kernel.event_buffer_kind(buffer)
        self.followed_map_fd = followed_map_fd
        self.consts, self.dt = layout.parse(header=HEADER)
        self.op_names: list[str] = list(pack.raw.get("ops", ()))
        self.obj: libbpf.BpfObject | None = None
        self.elfs, self.probes, self.warnings = [], [], []
        self.probed_files: set[tuple[int, int]] = set()
        self.attach_s, self.n_probes, self.n_events, self.n_decode_tokens = 0.0, 0, 0, 0
        self.decoding = False
        self.thread_names: dict[int, str] = {}
        self._records: list[bytes] = []
        self._events_seen: list[np.ndarray] = []
        self._untaken: list[np.ndarray] = []        # decode records not handed to a daemon yet
        self._lost_at_end = 0

    def attach(self) -> None:
        t0 = time.monotonic()
        kernel.require_root()
        self.elfs = engine_libraries(self.pack, [h for h, _ in self.lib_paths], self.root,
                                     [n for _, n in self.lib_paths])
        if not self.elfs:
            raise ProfinferError(f"no {self.pack.engine} in process {self.pid}")
        self.probes, self.warnings = resolve(self.pack, self.elfs, self.levels)
        self.obj = libbpf.BpfObject(bpfobj.object_path(self.pack.bpf, self.buffer))
        try:
            if self.followed_map_fd is not None:
                self.obj.reuse_map("followed", self.followed_map_fd)
            cfg = np.zeros(1, self.dt["pi_config"])
            cfg["transport"]["ring_wake_bytes"] = self.ringbuf_pages * 4096 // 4
            cfg["transport"]["follow"] = int(self.followed_map_fd is not None)
            self.obj.set_rodata(cfg.tobytes())
            if self.buffer == "ring":
                self.obj.set_max_entries("events", self.ringbuf_pages * 4096)
            self.obj.load({fn for p in self.probes for fn in (p.entry_fn, p.return_fn)})
            self._attach_probes(self.probes, {})
            self._events = EventTransport(self.obj, self.buffer, self._on_record,
                                          PERF_PAGES_PER_CPU, PERF_WAKEUP_EVENTS)
        except ProfinferError as e:
            self.detach()
            raise attach_failed(self.pid, e) from None
        self.attach_s = time.monotonic() - t0

    def _attach_probes(self, probes, paths: dict[str, str]) -> None:
        pid = -1 if self.followed_map_fd is not None else self.pid
        for p in probes:
            path = paths.get(p.elf.path, p.elf.path)
            file_id = p.elf.file_id if path == p.elf.path else None
            self.obj.attach_uprobe(p.entry_fn, path, p.symbol.file_offset + p.place.offset, pid, file_id=file_id)
            self.obj.attach_uprobe(p.return_fn, path, p.symbol.file_offset, pid, retprobe=True, file_id=file_id)
            self.n_probes += 2
            self.probed_files.add(discovery.file_key(path))

    def attach_files(self, lib_paths: list[tuple[str, str]]) -> list[str]:
        copies, skipped = copies_of_probed(self.pack, lib_paths, self.elfs, self.probed_files, self.root)
        for elf, host in copies:
            self._attach_probes([p for p in self.probes if p.elf is elf], {elf.path: host})
        return skipped

    def _on_record(self, data, size) -> None:
        self._records.append(ctypes.string_at(data, size))

    def fileno(self) -> int:
        return self._events.fileno()

    def poll(self, timeout_ms: int = 100) -> None:
        self._events.poll(timeout_ms)
        self._parse()

    def _parse(self) -> None:
        raw, self._records = self._records, []
        if not raw:
            return
        ev = np.frombuffer(b"".join(raw), self.dt["toy_event"])
        self._events_seen.append(ev)
        decodes = ev[ev["kind"] == self.consts["TOY_EV_DECODE"]]
        self._untaken.append(decodes)
        self.n_events += len(ev)
        self.n_decode_tokens += int(decodes["n_tokens"][decodes["pos0"] > 0].sum())
        self.decoding = True

    def refresh_process_info(self) -> None:
        names = discovery.thread_names(self.pid)
        if names:
            self.thread_names.update(names)

    def other_target_processes(self) -> list[int]:
        return []

    def lost(self) -> int:
        return self._events.lost() if self.obj else self._lost_at_end

    def take_tokens_by_process(self) -> dict[int, list[TokenCall]]:
        """The decode calls since the last take, by process (a daemon's shared probes)."""
        parts, self._untaken = self._untaken, []
        out: dict[int, list[TokenCall]] = {}
        for r in np.sort(np.concatenate(parts), order="start_ns") if parts else ():
            out.setdefault(int(r["tgid"]), []).append(_token(r))
        return out

    def finish(self) -> Profile:
        self._events.consume()
        self._parse()
        self._lost_at_end = self.lost()
        self.detach()
        ev = np.concatenate(self._events_seen) if self._events_seen else np.zeros(0, self.dt["toy_event"])
        ev = np.sort(ev, order="start_ns")
        decodes = ev[ev["kind"] == self.consts["TOY_EV_DECODE"]]
        ops = ev[ev["kind"] == self.consts["TOY_EV_OP"]]
        prof = Profile(pid=self.pid, process_name=discovery.process_name(self.pid) or "",
                       thread_names=dict(self.thread_names), lost_events=self._lost_at_end)
        prof.tokens = [_token(r) for r in decodes]
        prof.ops = [OpSlice(int(r["tid"]), int(r["cpu"]), int(r["start_ns"]), int(r["end_ns"]),
                            int(r["end_ns"]), self._op_name(int(r["op"])), "", (0, 0, 0, 0), "")
                    for r in ops]
        prof.meta.update({"engine": self.pack.engine, "pack": self.pack.name,
                          "levels": ",".join(sorted(self.levels)), "event_buffer": self.buffer,
                          "kernel": platform.release(), "attach_s": f"{self.attach_s:.3f}"})
        for e in self.elfs:
            prof.meta[f"build_id:{os.path.basename(e.path)}"] = e.build_id
        return prof

    def _op_name(self, op: int) -> str:
        return self.op_names[op] if 0 <= op < len(self.op_names) else f"op#{op}"

    def detach(self) -> None:
        if self.obj is not None:
            obj, self.obj = self.obj, None
            obj.close()


def _token(r) -> TokenCall:
    n = int(r["n_tokens"])
    return TokenCall.of_batch(int(r["tid"]), int(r["start_ns"]), int(r["end_ns"]), n, int(r["ret"]),
                              ((int(r["seq"]), int(r["pos0"]), n),))
