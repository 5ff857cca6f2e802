"""Every relative link in README.md and docs/*.md points to a file that exists, and, where it
names a heading (#anchor) in a Markdown file, to a heading that exists (GitHub's anchors)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    anchors, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_resolve():
    bad = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def _readme_commands() -> list[list[str]]:
    """Each `profinfer ...` line of README.md's code blocks (its trailing # comment cut), and
    each inline `profinfer ...` span of its text."""
    import shlex
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    lines = [ln.split(" # ")[0].strip() for b in blocks for ln in b.splitlines()]
    lines += re.findall(r"`(profinfer [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " "))
    out = []
    for ln in lines:
        for part in ln.split("&&"):
            words = shlex.split(part)
            if words and words[0].endswith("profinfer"):
                out.append(words[1:])
    return out


def test_readme_commands_parse():
    """Every profinfer command README.md prints names a command of the CLI and only options
    that command has (what follows `--` is the profiled command's own)."""
    from profinfer.cli import cli
    commands = _readme_commands()
    assert len(commands) >= 10, commands
    bad = []
    for words in commands:
        cmd = cli.commands.get(words[0])
        if cmd is None:
            bad.append(f"profinfer {words[0]}: no such command")
            continue
        known = {o for p in cmd.params for o in getattr(p, "opts", [])} | {"-h", "--help"}
        own = words[1:words.index("--")] if "--" in words else words[1:]
        bad += [f"profinfer {' '.join(words)}: no option {w}" for w in own
                if w.startswith("-") and w.split("=")[0] not in known]
    assert not bad, "\n".join(bad)
