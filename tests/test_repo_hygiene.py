"""The project speaks of itself as it is: no numbered work-period labels and no tracker references
in tracked files or file names.

A sentence such as "the cost table learned X (work period 13)" points at a history no reader
has; the condition and the number belong there instead ("fp32, one thread: 176 ms"). Tracker
references (an issue and part number) likewise. Git keeps the history.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dspark.paths import REPO_ROOT


# Written with character classes so that this file does not match itself.
LABEL = re.compile(
    r"(?<![A-Za-z])[Ss][Ee][Ss][Ss][Ii][Oo][Nn][Ss]?[\s_-]*\d+"  # a numbered work period, also in file names
    r"|\b[Tt][Hh][Ii][Ss]\s+[Ss][Ee][Ss][Ss][Ii][Oo][Nn]\b"
    r"|\b[Ii][Ss][Ss][Uu][Ee][Ss]?[\s_-]*#?\d+"  # a tracker reference (also across a line break)
    r"|\b[Pp][Aa][Rr][Tt][Ss]?\s+\d+\b"
    r"|(?<![A-Za-z-])[Ss][Tt][Oo][Pp][\s_-]*#?\d+\b"  # a numbered stopping point of the work
)
MAX_TEXT_BYTES = 2_000_000  # larger tracked files are data (weights, answer sets), not prose


def tracked_files() -> list[str]:
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, check=True,
                         capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def text_of(path: Path) -> str | None:
    """The file's text, or None for binary or oversized files (and files deleted but not staged)."""
    try:
        if path.stat().st_size > MAX_TEXT_BYTES:
            return None
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def labels_in(text: str) -> list[tuple[int, str, str]]:
    """(line number, label, its line) of every label in `text`, also of one split across a line
    break (the pattern's whitespace takes newlines, so the text is searched whole)."""
    found = []
    for match in LABEL.finditer(text):
        start = text.rfind("\n", 0, match.start()) + 1
        end = text.find("\n", match.start())
        line = text[start:end if end >= 0 else len(text)]
        found.append((text.count("\n", 0, match.start()) + 1, match.group(0), line))
    return found


def test_the_pattern_catches_labels_and_spares_ordinary_words():
    # split in two, so that this file's own text holds no label
    for labelled in ("as in sess" "ion 13", "Sess" "ion 7's run", "sess" "ions 13-15",
                     "loadtest_sess" "ion9/", "iss" "ue 5 pa" "rt 4", "(Iss" "ue 4)", "iss" "ue #12",
                     "this sess" "ion found", "in pa" "rt 3",
                     "16 users (sess" "ion\n        15)", "iss" "ue\n 7", "as in st" "op 36",
                     "St" "op 4's run", "loadtest_st" "op9/", "st" "op\n 12"):
        assert LABEL.search(labelled), labelled
    for plain in ("a session token", "the phase-2 drafter", "part of the prompt", "issues a request",
                  "sessionless", "parts of 15 MiB", "stop tokens", "stop strings 3 and 4",
                  "non-stop 24 hours", "the stop_token_ids", "stopped 3 requests"):
        assert not LABEL.search(plain), plain


def test_the_scan_finds_a_label_split_across_lines():
    text = "first line\nmeasured in sess" "ion\n13 with\nlast line, st" "op\n36\n"
    assert [(number, line) for number, _, line in labels_in(text)] == [
        (2, "measured in sess" "ion"), (4, "last line, st" "op")]


def test_no_work_period_labels_in_tracked_files_or_names():
    files = tracked_files()
    assert len(files) > 100  # the scan really saw the repository
    found = []
    for name in files:
        if LABEL.search(name):
            found.append(f"{name}: file name")
        text = text_of(REPO_ROOT / name)
        if text is None:
            continue
        for number, label, line in labels_in(text):
            found.append(f"{name}:{number}: {label!r} in {line.strip()[:120]}")
    assert not found, ("state the condition and the number instead of a work-period label or "
                       "tracker reference:\n" + "\n".join(found))


README_MAX_CHARS = 9000
README_MAX_LINE = 120
SETUP_COMMANDS = (
    'bash scripts/setup.sh && .venv/bin/dspark generate --chat --stats "',
    "bash scripts/test.sh",
)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks (the fences excluded)."""
    lines, in_code = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            lines.append((number, line))
    return lines


def test_prose_lines_skip_code_blocks():
    text = "a\n```bash\n" + "x" * 200 + "\n```\nb\n"
    assert prose_lines(text) == [(1, "a"), (5, "b")]


def test_readme_is_a_front_page():
    """The README stays short enough to read: under 9,000 characters, no prose or table line over
    120 characters (results belong in docs/results/), and the two set-up commands, each alone on
    a line of a code block, so that they can be copied as they are."""
    text = (REPO_ROOT / "README.md").read_text()
    assert len(text) < README_MAX_CHARS, f"README.md has {len(text)} characters"
    long = [f"{n}: {len(line)} characters" for n, line in prose_lines(text) if len(line) > README_MAX_LINE]
    assert not long, long
    code = {line for line in text.splitlines()} - {line for _, line in prose_lines(text)}
    for command in SETUP_COMMANDS:
        assert any(line.startswith(command) for line in code), command
