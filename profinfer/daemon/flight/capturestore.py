"""The flight recorder's kept captures, in a directory of the daemon's own (a writable
volume): at most `keep`, under a total byte cap, the oldest of the tenant with the most (in
number, or in bytes past the cap) going first. Each is a Perfetto trace (ID.pftrace) and
its record (ID.json: the process, the trigger and what it saw, the levels asked for and
recorded, what the budget left out, the cost), each written whole under a temporary name,
synced, then renamed (and the directory synced): a crash leaves a file whole or not there.
The trace is written before its record, so a crash between them leaves a trace no record
names: each start removes what is not a whole capture (a temporary file, a trace without its
record, a record without its trace or unreadable). Records are what /captures lists; a trace
is read only by an ID it lists."""
from __future__ import annotations

import json
import os
import re
import secrets
import stat
import threading
import time
from collections import Counter

from profinfer.core.base.errors import ProfinferError

CAPTURE_ID = re.compile(r"^[0-9]{8}T[0-9]{6}-[0-9]+-[0-9a-f]{6}$")


class CaptureStore:
    def __init__(self, directory: str, keep: int, max_bytes: int):
        self.dir = os.path.abspath(directory)
        self.keep, self.max_bytes = keep, max_bytes
        self.lock = threading.Lock()
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            st = os.lstat(self.dir)
        except OSError as e:
            raise ProfinferError(f"--captures-dir {directory}: {e.strerror}: give the daemon a writable "
                                 "directory of its own (a hostPath or emptyDir volume)") from None
        # the daemon's own: not a link, owned by it, written by nobody else
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ProfinferError(f"--captures-dir {directory}: not a directory of the daemon's own "
                                 "(a link, another owner's, or writable by others)")
        try:
            self.records = self._load()
        except OSError as e:
            raise ProfinferError(f"--captures-dir {directory}: {e.strerror}") from None
        self._prune()

    def _load(self) -> list[dict]:
        """The whole captures kept; the rest of what a crash left removed."""
        out, names = [], set(os.listdir(self.dir))
        for name in sorted(names):
            cid, ext = os.path.splitext(name)
            if ext != ".json" or not CAPTURE_ID.fullmatch(cid) or cid + ".pftrace" not in names:
                continue
            try:
                with open(os.path.join(self.dir, name)) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and record.get("id") == cid:
                out.append(record)
        whole = {name for r in out for name in (r["id"] + ".json", r["id"] + ".pftrace")}
        for name in names - whole:
            # a write a crash cut short, a trace whose record was never written, a record
            # without its trace; nothing else of ours is ever here (other names stay)
            cid, ext = os.path.splitext(name)
            if ext == ".tmp" or (ext in (".json", ".pftrace") and CAPTURE_ID.fullmatch(cid)):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except FileNotFoundError:
                    pass
        return sorted(out, key=lambda r: r.get("kept_at", 0))

    def _trace_path(self, cid: str) -> str:
        return os.path.join(self.dir, cid + ".pftrace")

    def _write(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)            # the rename itself on disk
            finally:
                os.close(dir_fd)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def add(self, record: dict, trace: bytes) -> dict:
        """Keep a capture (the oldest go past `keep` captures or `max_bytes`); its record, with
        its ID. A trace over the byte cap alone is not kept (ProfinferError)."""
        if len(trace) > self.max_bytes:
            raise ProfinferError(f"a trace of {len(trace):,} bytes is over the captures' cap of "
                                 f"{self.max_bytes:,} bytes: not kept")
        with self.lock:
            cid = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{record.get('pid', 0)}-{secrets.token_hex(3)}"
            record = {**record, "id": cid, "bytes": len(trace), "kept_at": time.time()}
            self._write(self._trace_path(cid), trace)
            self._write(os.path.join(self.dir, cid + ".json"), (json.dumps(record, indent=1) + "\n").encode())
            self.records.append(record)
            self._prune(newest=cid)
        return record

    def _prune(self, newest: str | None = None) -> None:
        """Past `keep`, the oldest capture of the tenant with the most kept goes; past the byte
        cap, the oldest of the tenant with the most bytes kept: one tenant's incidents evict
        its own, never another tenant's while it holds more. The capture just kept (`newest`)
        is never the one that goes: it fits the cap alone, and the caller was told it is kept."""
        while self.records:
            older = [r for r in self.records if r["id"] != newest]
            if not older:
                break
            if len(self.records) > self.keep:
                kept = Counter(r.get("tenant") for r in older)
            elif sum(r.get("bytes", 0) for r in self.records) > self.max_bytes:
                kept = Counter()
                for r in older:
                    kept[r.get("tenant")] += r.get("bytes", 0)
            else:
                break
            most = max(kept.values())
            old = next(r for r in older if kept[r.get("tenant")] == most)
            self.records.remove(old)
            for path in (self._trace_path(old["id"]), os.path.join(self.dir, old["id"] + ".json")):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def list(self) -> list[dict]:
        with self.lock:
            return [dict(r) for r in self.records]

    def trace(self, cid: str) -> bytes | None:
        """A kept capture's trace; None for an ID not kept (or not one at all)."""
        with self.lock:
            if not CAPTURE_ID.fullmatch(cid) or not any(r["id"] == cid for r in self.records):
                return None
            try:
                with open(self._trace_path(cid), "rb") as f:
                    return f.read(self.max_bytes + 1)
            except OSError:
                return None
