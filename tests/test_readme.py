"""What the README and the user docs promise about themselves.

- the README stays a user's page: at most 200 lines;
- .ci/run runs the README's test command verbatim, so CI tests what a user runs;
- every install line of the README and docs/ works from a clone as written: ``pip install``
  of a local path (``.``, ``".[extra]"``, ``dist/*.whl``) or a pinned PyPI requirement, never
  ``exactblocks`` itself from PyPI (it is not published there);
- every link to a file of the repository points at a file that exists (pages other sessions
  are writing are listed in ``PENDING``);
- no issue numbers in the user docs.

The pages' Python blocks run in tests/test_docs.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the pages a user or a new contributor reads (docs/architecture.md is the developers' map of
# the code, kept with the code's layers)
USER_DOCS = [
    README,
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "architecture.md"),
    ROOT / "CONTRIBUTING.md",
]


def _bash_lines(text: str) -> list[str]:
    """The command lines of the ```bash blocks of a page (continuations joined)."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        block = block.replace("\\\n", " ")
        lines += [line.strip() for line in block.splitlines() if line.strip()]
    return lines


def test_readme_is_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines; move detail to docs/"


def test_ci_runs_the_readme_test_command_verbatim():
    tests = [line for line in _bash_lines(README.read_text()) if "python -m pytest" in line]
    assert len(tests) == 1, f"expected one test command in README.md, found {tests}"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in ci, "the README's test command is not a line of .ci/run"


def _pip_install_targets(line: str) -> list[str]:
    out = []
    for part in line.split("&&"):
        if not part.strip().startswith("pip install"):
            continue
        words = shlex.split(part.split("#", 1)[0])
        skip_next = False
        for w in words[2:]:
            if skip_next:
                skip_next = False
            elif w in ("--index-url", "--extra-index-url", "-r", "-c"):
                skip_next = True
            elif not w.startswith("-"):
                out.append(w)
    return out


def test_install_lines_work_from_a_clone():
    seen = 0
    for page in USER_DOCS:
        for line in _bash_lines(page.read_text()):
            for target in _pip_install_targets(line):
                seen += 1
                local = target.startswith((".", "dist/")) or target.startswith('".')
                pinned = re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z,]+\])?==[0-9][\w.]*", target)
                assert local or pinned, (
                    f"{page.name}: {target!r} in {line!r} is neither a local path nor a pinned "
                    "PyPI requirement"
                )
                assert not re.match(r"exactblocks\b", target), (
                    f"{page.name}: {line!r} installs exactblocks from PyPI, where it is not "
                    'published; use pip install ".[extra]" from a clone'
                )
    assert seen >= 3


# Pages that other parts of the project are writing; linked from the README's index.
PENDING = {"docs/text.md", "docs/adding-a-family.md"}


@pytest.mark.parametrize("page", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_at_files(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path = (page.parent / target).resolve()
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        assert path.exists() or rel in PENDING, f"{page.name}: link to missing {target}"


@pytest.mark.parametrize("page", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_name_no_issue_numbers(page):
    found = re.findall(r"(?i)\bissues? #?\d+|(?<![\w&/])#\d+\b", page.read_text())
    assert not found, f"{page.name}: issue numbers {found}; user docs speak to users"
