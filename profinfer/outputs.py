"""A run's output files: refused before profiling if they cannot be written, and never lost
at the end: one that still fails (disk full, directory removed meanwhile) is saved elsewhere."""
from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import Profile


@dataclass
class Output:
    option: str                                   # "-o", "--json": named in messages
    path: str
    kind: str                                     # "timeline", "summary"
    suffix: str                                   # of a copy saved elsewhere
    write: Callable[[Profile, str], None]


def requested(output: str | None, json_path: str | None, html_path: str | None = None) -> list[Output]:
    from profinfer.exporters import json_summary, perfetto
    from profinfer.viewers import flight, html
    made: dict[int, dict] = {}

    def summary(profile: Profile) -> dict:
        """The JSON summary, computed once for the --json file and the page that draws it."""
        if id(profile) not in made:
            made.clear()
            made[id(profile)] = json_summary.summary(profile)
        return made[id(profile)]

    def write_json(profile: Profile, path: str) -> None:
        json_summary.write_summary(summary(profile), path)

    outs = []
    if output:
        chrome = output.endswith(".json")
        outs.append(Output("-o", output, "timeline", ".json" if chrome else ".pftrace",
                           perfetto.write_chrome_json if chrome else perfetto.write_perfetto))
    if json_path:
        outs.append(Output("--json", json_path, "summary", ".json", write_json))
    if html_path:
        outs.append(Output("--html", html_path, "page", ".html",
                           lambda profile, path: html.write_html(summary(profile), path,
                                                                 labels={"flight_families": flight.FAMILIES})))
    return outs


_FIFOS_KEPT_OPEN: list[int] = []


def check_writable(outs: list[Output]) -> None:
    """Raise ProfinferError unless every output can be opened for writing (created and removed
    again if it did not exist), so that a bad path is found before anything is profiled."""
    seen: dict[str, str] = {}
    for out in outs:
        real = os.path.realpath(out.path)
        if real in seen:
            raise ProfinferError(f"{seen[real]} and {out.option} name the same file: {out.path}")
        seen[real] = out.option
        existed = os.path.lexists(out.path)
        try:
            # O_NONBLOCK: a FIFO without a reader fails at once instead of hanging here.
            fd = os.open(out.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
        except OSError as e:
            raise ProfinferError(f"cannot write {out.option} {out.path}: {e.strerror}") from None
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            # closed now, the FIFO's last writer would end its reader's input before the
            # real write: kept open until this process exits
            _FIFOS_KEPT_OPEN.append(fd)
        else:
            os.close(fd)
        if not existed:
            os.unlink(out.path)


def _rescue_dirs() -> list[str]:
    dirs = [tempfile.gettempdir(), os.getcwd(), os.path.expanduser("~")]
    return list(dict.fromkeys(os.path.realpath(d) for d in dirs))


def _save_elsewhere(profile: Profile, out: Output) -> str | None:
    stem = os.path.splitext(os.path.basename(out.path))[0] or out.kind
    for d in _rescue_dirs():
        try:
            fd, path = tempfile.mkstemp(prefix=f"profinfer-unsaved-{stem}-", suffix=out.suffix, dir=d)
        except OSError:
            continue
        os.close(fd)
        try:
            out.write(profile, path)
            return path
        except OSError:
            _remove_partial(path, None)
    return None


def _identity(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _remove_partial(path: str, before: tuple | None) -> None:
    """A regular file that a failed write created or truncated is cut short: it must not pass
    for a result. One the write never opened (unchanged since `before`) is left alone."""
    try:
        if os.path.isfile(path) and _identity(path) != before:
            os.unlink(path)
    except OSError:
        pass


def write_all(profile: Profile, outs: list[Output], say: Callable[[str], None],
              error: Callable[[str], None]) -> bool:
    """Write each output; one that fails is saved in a temporary directory (or the current or
    home directory) and said where. True when all went where they were asked to."""
    ok = True
    for out in outs:
        before = _identity(out.path)
        try:
            out.write(profile, out.path)
            say(f"wrote {out.path}")
            continue
        except OSError as e:
            reason = e.strerror or str(e)
        ok = False
        _remove_partial(out.path, before)
        saved = _save_elsewhere(profile, out)
        if saved:
            error(f"cannot write {out.option} {out.path} ({reason}); the {out.kind} is saved in {saved}")
        else:
            error(f"cannot write {out.option} {out.path} ({reason}), nor in {', '.join(_rescue_dirs())}: "
                  f"the {out.kind} is lost")
    return ok
