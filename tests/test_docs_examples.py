"""Every ```python block of README.md and docs/*.md runs, so that the examples never rot.

A block runs in a fresh namespace, in this process. A block that cannot run standalone (it
needs a hosted account or a running server) is preceded by the line
``<!-- docs-test: skip (reason) -->``; their number is bounded so that skipping does not become
the habit. Other fences (bash, toml, text) are not executed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
SKIP = re.compile(r"^<!-- docs-test: skip \((?P<reason>[^)]+)\) -->$")
#: At most this many blocks may be marked skipped (today: the four that need a server).
MAX_SKIPPED = 5


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of a Markdown page, with their skip annotations."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            prev = next(
                (lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), ""
            )
            m = SKIP.match(prev)
            found.append(Block(path, start + 1, "\n".join(lines[start + 1 : j]), m and m["reason"]))
            i = j
        elif SKIP.match(lines[i].strip()):
            nxt = next((x.strip() for x in lines[i + 1 :] if x.strip()), "")
            assert nxt == "```python", (
                f"{path.name}:{i + 1}: a skip mark must precede a python block"
            )
        i += 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def test_the_pages_have_examples_and_few_are_skipped():
    assert len([b for b in ALL if b.skip is None]) >= 5
    skipped = [b.id for b in ALL if b.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, f"too many skipped doc blocks: {skipped}"


def test_the_collector_reads_fences_and_marks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "x\n```python\nprint(1)\n```\n\n<!-- docs-test: skip (needs a server) -->\n"
        "```python\nimport nothing\n```\n```bash\nfalse\n```\n"
    )
    found = blocks(page)
    assert [(b.line, b.code, b.skip) for b in found] == [
        (2, "print(1)", None),
        (7, "import nothing", "needs a server"),
    ]


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.id)
def test_python_block_runs(block):
    if block.skip is not None:
        pytest.skip(block.skip)
    namespace = {"__name__": "__docs_example__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block.code, block.id, "exec"), namespace)  # noqa: S102 - our own docs
