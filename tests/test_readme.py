"""README.md stays a short, working user's document.

Its Python API example runs (in a fresh interpreter, from the repository
root), it is at most MAX_LINES lines, and every relative link in README.md
and docs/*.md points at an existing file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 320

_HEADING = re.compile(r"#{1,6} ")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCED = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)


def fenced_blocks(text: str) -> list[tuple[str, str, str]]:
    """(last heading above, fence info string, body) of every fenced block, in order."""
    out = []
    heading, fence, body = "", None, []
    for line in text.splitlines():
        if fence is not None:
            if line.startswith("```"):
                out.append((heading, fence, "\n".join(body)))
                fence = None
            else:
                body.append(line)
        elif line.startswith("```"):
            fence, body = line[3:].strip(), []
        elif _HEADING.match(line):
            heading = line
    return out


def python_api_code() -> list[str]:
    """The ```python blocks under the heading that contains "Python API"."""
    return [body for heading, info, body in fenced_blocks(README.read_text())
            if "Python API" in heading and info == "python"]


def relative_links(path: Path) -> list[str]:
    """Targets of the Markdown links and images of ``path`` that are files of this repository."""
    text = _FENCED.sub("", path.read_text())  # code blocks hold no links
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        targets.append(target.split("#", 1)[0])
    return targets


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; keep it at most {MAX_LINES} (detail goes to docs/)"


def test_python_api_example_runs() -> None:
    blocks = python_api_code()
    assert blocks, "README.md has no ```python block under a heading containing 'Python API'"
    for code in blocks:
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"README's Python API example failed:\n{code}\n--- stderr ---\n{run.stderr}"
        assert run.stdout.strip(), "README's Python API example printed nothing"


def test_relative_links_point_at_files() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = [f"{page.relative_to(ROOT)}: {target}" for page in pages for target in relative_links(page)
               if not (page.parent / target).exists()]
    assert not missing, "relative links to missing files:\n" + "\n".join(missing)


def test_link_check_sees_links() -> None:
    # The checker itself: README links to docs/, and a fenced block's text is not read as a link.
    assert "docs/design.md" in relative_links(README)
    assert not any(t.startswith("http") for t in relative_links(README))
