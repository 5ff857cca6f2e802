"""Set-up on a site's own mirrors: the Debian archive is read from the machine's apt sources
(deploy/debian_archive.py, used by setup.sh for the non-free component and by the base image's
debootstrap), and the repository names no package host or registry."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
import debian_archive  # noqa: E402


def _root(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "etc/apt/sources.list.d").mkdir(parents=True)
    (tmp_path / "etc/os-release").write_text('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nVERSION_CODENAME=bookworm\n')
    for name, text in files.items():
        (tmp_path / "etc/apt" / name).write_text(text)
    return tmp_path


def _source(root: Path) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "deploy/debian_archive.py"), "--root", str(root),
                          "source", "non-free"], capture_output=True, text=True, check=True)
    return out.stdout


def test_deb822_main_archive_with_its_key(tmp_path):
    root = _root(tmp_path, {
        "sources.list.d/debian.sources": (
            "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
            "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
            "Types: deb deb-src\n# a comment\nURIs: http://mirror.example/debian http://proxy.example:3142/debian\n"
            "Suites: bookworm bookworm-updates\nComponents: main contrib\n"
            "Signed-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n xsFNBF\n -----END PGP PUBLIC KEY BLOCK-----\n"),
        # what setup.sh wrote on an earlier run is never a source of the derivation
        "sources.list.d/profinfer-debian-non-free.sources": (
            "Types: deb\nURIs: http://stale.example/debian\nSuites: bookworm\nComponents: main non-free\n"),
    })
    assert _source(root) == (
        "Types: deb\nURIs: http://mirror.example/debian http://proxy.example:3142/debian\n"
        "Suites: bookworm\nComponents: non-free\nSigned-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n"
        " .\n xsFNBF\n -----END PGP PUBLIC KEY BLOCK-----\n")
    e, suite = debian_archive.main_archive(root)
    assert suite == "bookworm" and e.uris[0] == "http://mirror.example/debian"


def test_one_line_sources_disabled_and_other_suites_skipped(tmp_path):
    root = _root(tmp_path, {
        "sources.list": (
            "# deb cdrom:[Debian GNU/Linux 12]/ bookworm main\n"
            "deb http://mirror.example/debian-security bookworm-security main\n"
            "deb-src http://src.example/debian bookworm main\n"
            "deb [arch=amd64 signed-by=/etc/apt/keyrings/site.gpg] http://mirror.example/debian/ bookworm main  # site mirror\n"),
        "sources.list.d/off.sources": (
            "Enabled: no\nTypes: deb\nURIs: http://off.example/debian\nSuites: bookworm\nComponents: main\n"),
    })
    assert _source(root) == ("Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm\n"
                             "Components: non-free\nSigned-By: /etc/apt/keyrings/site.gpg\n")


def test_no_main_archive_says_so(tmp_path):
    root = _root(tmp_path, {"sources.list": "deb http://mirror.example/debian-security bookworm-security main\n"})
    out = subprocess.run([sys.executable, str(ROOT / "deploy/debian_archive.py"), "--root", str(root), "uri"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "bookworm" in out.stderr


def test_this_machine_has_a_main_archive():
    e, suite = debian_archive.main_archive(Path("/"))
    assert e.uris and suite


# placeholders and the machine itself: nothing a site would have to reach
PLACEHOLDER = re.compile(r"^(localhost|127\.0\.0\.1|\[::1\]?|0\.0\.0\.0|collector|[\w.-]*example(\.\w+)?|[^{]*\{.*)(:.*)?$")


def test_no_package_host_or_registry_named():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named = []
    for f in files:
        path = ROOT / f
        if not path.is_file() or path.suffix in (".gguf", ".o", ".png") or path.stat().st_size > 2_000_000:
            continue
        text = path.read_text(errors="replace")
        for m in re.finditer(r"\b(https?|ftp|docker|oci)://([^/\s\"'`)>\]]+)", text):
            if not PLACEHOLDER.match(m.group(2)):
                named.append(f"{f}: {m.group(0)}")
    assert not named, named
    # images: by name only (a site's registry is its own choice)
    manifest = [d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/profinfer.yaml").read_text()) if d]
    images = [c["image"] for d in manifest if d["kind"] == "DaemonSet"
              for c in d["spec"]["template"]["spec"]["containers"]]
    images += re.findall(r"^FROM\s+(\S+)", (ROOT / "deploy/Containerfile").read_text(), re.M)
    for image in images:
        first = image.split("/")[0]
        assert "/" not in image or first == "localhost" or not re.search(r"[.:]", first), image
