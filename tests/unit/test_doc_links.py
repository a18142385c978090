"""Every Markdown file the sources, tests and docs name exists, and the README stays short.

A mention is a path-like word ending in `.md` (a bare name, a relative path, a Markdown
link target; URLs are skipped). It resolves against the repository root, the mentioning
file's folder or `docs/`, so a bare name counts if it is in the root or in `docs/`.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250

# No path character, dot or colon right before (so a URL's path is never a mention).
MENTION = re.compile(r"(?<![\w/.:-])((?:\.\.?/)*(?:[\w.-]+/)*[\w-][\w.-]*\.md)(?!\w)")


def _files() -> list[Path]:
    files = [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md")]
    for top in ("src", "tests"):
        files += [p for p in (ROOT / top).rglob("*.py") if not any(
            part.endswith(".egg-info") or part in {".venv", ".peer", "runs"} for part in p.parts)]
    return sorted(files)


def dangling(path: Path, text: str) -> list[str]:
    """The `.md` mentions in `text` (from `path`) that name no file."""
    bases = (ROOT, path.parent, ROOT / "docs")
    return [f"{path.relative_to(ROOT)}: {name}" for name in MENTION.findall(text)
            if not any((base / name).is_file() for base in bases)]


def test_every_md_path_mentioned_exists() -> None:
    missing = [m for p in _files() for m in dangling(p, p.read_text(encoding="utf-8"))]
    assert not missing, "dangling .md references:\n" + "\n".join(missing)


def test_a_dangling_mention_is_caught() -> None:
    gone = "NOPE_NOT_THERE" + ".md"  # built here, so this file names no missing page
    text = f"see {gone}, [x](docs/{gone}) and https://example.org/{gone}"
    assert len(dangling(ROOT / "README.md", text)) == 2
    assert dangling(ROOT / "docs" / "USAGE.md", "[guarantees](GUARANTEES.md) ../CONTRIBUTING.md") == []


def test_readme_is_read_in_five_minutes() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
