#!/usr/bin/env python3
"""The Debian archive this machine's apt already uses, read from its own sources (sites use
their own mirrors and proxies, so no host is named here):

    /etc/apt/sources.list, /etc/apt/sources.list.d/*.list   one-line form
    /etc/apt/sources.list.d/*.sources                       deb822 form

The main archive is the entry of type `deb` whose suite is the release's codename itself (not
-updates or -security) and whose components include `main`.

    debian_archive.py uri                 its first URI (for debootstrap)
    debian_archive.py suite               its suite (bookworm)
    debian_archive.py source non-free     a deb822 stanza: the same URIs, suite and Signed-By,
                                          with the given components
    debian_archive.py keyring             its Signed-By file (debootstrap's --keyring), if any
    debian_archive.py image-sources       deb822 stanzas for an image of this release: every
                                          enabled `deb` entry of the release's suites (itself,
                                          -updates, -security), component main only
    debian_archive.py --root DIR ...      read DIR/etc/... instead (tests)

Exits 1, saying why, when no such entry is found.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

OWN = "profinfer-debian-"      # the files setup.sh writes: never a source of the derivation


@dataclass
class Entry:
    types: list[str]
    uris: list[str]
    suites: list[str]
    components: list[str]
    signed_by: list[str] = field(default_factory=list)   # a path, or an inline key's lines
    enabled: bool = True


def _deb822(text: str) -> list[Entry]:
    out = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, list[str]] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key:      # a continuation line (an inline key)
                fields[key].append(line)
                continue
            name, sep, value = line.partition(":")
            if not sep:
                continue
            key = name.strip().lower()
            fields[key] = [value.strip()]
        if "uris" not in fields:
            continue
        words = lambda k: " ".join(fields.get(k, [""])).split()
        signed = fields.get("signed-by", [])
        signed = signed if any(v.strip() for v in signed) else []
        out.append(Entry(words("types"), words("uris"), words("suites"), words("components"),
                         signed, " ".join(fields.get("enabled", ["yes"])).strip().lower() != "no"))
    return out


def _one_line(text: str) -> list[Entry]:
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        options = {}
        m = re.match(r"(\S+)\s+\[([^\]]*)\]\s*(.*)", line)
        if m:
            kind, opts, rest = m.groups()
            for o in opts.split():
                k, _, v = o.partition("=")
                options[k.lower()] = v
            parts = [kind, *rest.split()]
        else:
            parts = line.split()
        if len(parts) < 3:
            continue
        signed = [options["signed-by"]] if options.get("signed-by") else []
        out.append(Entry([parts[0]], [parts[1]], [parts[2]], parts[3:], signed))
    return out


def entries(root: Path) -> list[Entry]:
    apt = root / "etc/apt"
    files = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    found = [e for f in files if f.is_file() and not f.name.startswith(OWN)
             for e in _one_line(f.read_text(errors="replace"))]
    for f in sorted((apt / "sources.list.d").glob("*.sources")):
        if not f.name.startswith(OWN):
            found += _deb822(f.read_text(errors="replace"))
    return found


def codename(root: Path) -> str:
    text = (root / "etc/os-release").read_text() if (root / "etc/os-release").is_file() else ""
    m = re.search(r'^VERSION_CODENAME="?([a-z]+)', text, re.M)
    return m.group(1) if m else "bookworm"


def main_archive(root: Path) -> tuple[Entry, str]:
    suite = codename(root)
    for e in entries(root):
        if (e.enabled and "deb" in e.types and suite in e.suites and "main" in e.components
                and any(not u.startswith(("cdrom:", "file:")) for u in e.uris)):
            return e, suite
    raise LookupError(f"no apt source of type deb for suite {suite} with component main "
                      f"in {root / 'etc/apt'}")


def release_entries(root: Path) -> list[tuple[Entry, list[str]]]:
    """Every enabled deb entry with main of this release's suites, with those suites."""
    suite = codename(root)
    out = []
    for e in entries(root):
        suites = [s for s in e.suites if s == suite or s.startswith(suite + "-")]
        if e.enabled and "deb" in e.types and "main" in e.components and suites:
            out.append((e, suites))
    return out


def stanza(e: Entry, suite: str, components: list[str]) -> str:
    lines = ["Types: deb", "URIs: " + " ".join(u for u in e.uris if not u.startswith("cdrom:")),
             f"Suites: {suite}", "Components: " + " ".join(components)]
    if e.signed_by:
        lines.append(("Signed-By: " + e.signed_by[0]).rstrip())
        lines += e.signed_by[1:]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path("/"))
    p.add_argument("what", choices=("uri", "suite", "source", "keyring", "image-sources"))
    p.add_argument("components", nargs="*", default=["non-free"])
    a = p.parse_args(argv)
    try:
        e, suite = main_archive(a.root)
    except (LookupError, OSError) as err:
        print(f"debian_archive: {err}", file=sys.stderr)
        return 1
    if a.what == "uri":
        print(next(u for u in e.uris if not u.startswith(("cdrom:", "file:"))))
    elif a.what == "suite":
        print(suite)
    elif a.what == "keyring":
        if e.signed_by and e.signed_by[0].startswith("/"):
            print(e.signed_by[0])
    elif a.what == "image-sources":
        sys.stdout.write("\n".join(stanza(x, " ".join(suites), ["main"])
                                   for x, suites in release_entries(a.root)))
    else:
        sys.stdout.write(stanza(e, suite, a.components))
    return 0


if __name__ == "__main__":
    sys.exit(main())
