"""Every runnable code block of README.md and docs/*.md runs, and relative links resolve.

Convention (docs/index.md, "Code blocks"):

- blocks fenced as ```python run, in file order, sharing one namespace per file, in a fresh
  temporary working directory;
- a block is opted out by an HTML comment ``<!-- skip: reason -->`` as the last non-blank
  line before its fence (for blocks that need a bucket, a GPU, a CLI...);
- other fences (```bash, ```console, ```text, ```json...) never run.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)[^\n]*$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(\S.*?)\s*-->\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the first code line
    code: str
    skip: str | None


def code_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match.groups()
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        skip = SKIP.match(before)
        body, i = [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i])
            i += 1
        code = textwrap.dedent("\n".join(body))
        first_line = i - len(body) + 1
        blocks.append(Block(lang.lower(), first_line, code, skip.group(1) if skip else None))
        i += 1
    return blocks


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", DOC_FILES, ids=_id)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    blocks = [b for b in code_blocks(path.read_text()) if b.lang in ("python", "py")]
    runnable = [b for b in blocks if b.skip is None]
    if not runnable:
        pytest.skip(f"{_id(path)} has no runnable python block ({len(blocks)} opted out)")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc_example__"}
    for block in runnable:
        try:
            exec(compile(block.code, f"{_id(path)}:{block.line}", "exec"), namespace)
        except Exception as exc:
            exc.add_note(f"in the python block at {_id(path)}, line {block.line}")
            raise


def test_skip_markers_give_a_reason():
    for path in DOC_FILES:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"^\s*<!--\s*skip\b", line):
                assert SKIP.match(line), f"{_id(path)}:{line_no}: write <!-- skip: reason -->"


@pytest.mark.parametrize("path", DOC_FILES, ids=_id)
def test_relative_links_resolve(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # absolute URLs and same-page anchors
        file_part = target.split("#", 1)[0]
        if file_part and not (path.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{_id(path)} links to missing files: {broken}"


def test_code_block_parser():
    text = "\n".join([
        "intro", "```python", "x = 1", "```", "", "<!-- skip: needs a bucket -->", "",
        "```python", "boom()", "```", "```bash", "make test", "```", "  ```python", "  y = x + 1",
        "  ```",
    ])
    blocks = code_blocks(text)
    assert [(b.lang, b.line, b.code, b.skip) for b in blocks] == [
        ("python", 3, "x = 1", None),
        ("python", 9, "boom()", "needs a bucket"),
        ("bash", 12, "make test", None),
        ("python", 15, "y = x + 1", None),
    ]


def test_readme_quick_start_is_two_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [b.code.strip() for b in code_blocks(section) if b.lang in ("bash", "sh", "console", "")]
    assert "\n".join(commands).split() == ["make", "demo", "make", "test"]
