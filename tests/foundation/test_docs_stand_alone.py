"""The project's documentation stands alone: no tracked file points at design notes that live outside the repository,
and every relative link of the README and of ``docs/`` reaches a file that exists.

The notes the code was first written from are not part of the repository, so a reader cannot follow a reference to
them; what the code relies on is in ``docs/`` (``deepseek_v4.md``, ``deepseek_v41.md``, ``chat_format.md``,
``architecture.md``, ...), cited by file and section name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Names of the outside notes, assembled from pieces so that this file does not match itself.
_NOTES = ("MODEL" + "_V41", "MODEL" + "_V4", "CHAT" + "_ENCODING", "ARCHI" + "TECTURE", "PRAC" + "TICES")
_ANCHOR_NOTES = ("PERF" + "_ANCHORS", "SERVING" + "_ANCHORS", "ENV" + "_FACTS")
_SECTION = "\u00a7"  # the section sign the notes' references use
OUTSIDE = re.compile(
    "|".join(
        [
            # a note by file name, or by name and section number ("<NOTE> §3.1")
            rf"\b(?:{'|'.join(_NOTES + _ANCHOR_NOTES)})(?:\.md\b|\s*{_SECTION})",
            # the notes whose names are distinctive enough to flag bare
            rf"\b(?:{'|'.join(_ANCHOR_NOTES)})\b",
            # the folders they live in
            re.escape("shared" + "/design"),
            re.escape("shared" + "/seeds"),
            re.escape(".." + "/shared"),
        ]
    )
)
SKIP_DIRS = ("libs/deepinfer/v1/",)  # generated protobuf code


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and not p.startswith(SKIP_DIRS)]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary (or missing) file."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):  # deleted or moved in the working tree
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def outside_references() -> list[str]:
    found = []
    for rel in tracked_files():
        text = text_of(ROOT / rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:160]}")
    return found


def test_pattern_catches_the_forms_in_use():
    sec = _SECTION
    hits = [
        "see " + "MODEL" + "_V4.md " + sec + "4.2",
        "(" + "MODEL" + "_V41 " + sec + "6.2)",
        "PRAC" + "TICES " + sec + "C4",
        "CHAT" + "_ENCODING.md",
        "ENV" + "_FACTS " + sec + "1",
        "/work/shared" + "/design/x.md",
        "../" + "shared" + "/seeds/",
    ]
    misses = ["docs/architecture.md", 'ARCHITECTURE = "DeepseekV41ForCausalLM"', "docs/deepseek_v4.md, " + '"CSA"']
    assert all(OUTSIDE.search(h) for h in hits), [h for h in hits if not OUTSIDE.search(h)]
    assert not any(OUTSIDE.search(m) for m in misses), [m for m in misses if OUTSIDE.search(m)]


def test_no_references_to_outside_design_notes():
    found = outside_references()
    assert not found, (
        f"{len(found)} line(s) point at design notes outside the repository; cite docs/ (file and section name) or "
        "state the fact inline:\n" + "\n".join(found)
    )


LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link outside fenced code blocks."""
    links, in_code = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        links += [(n, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return links


def broken_links() -> list[str]:
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if not doc.exists():
            continue
        for n, target in markdown_links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # http(s), mailto, ... and anchors within the page
            rel = target.split("#", 1)[0]
            if not (doc.parent / rel).exists():
                bad.append(f"{doc.relative_to(ROOT)}:{n}: {target}")
    return bad


def test_markdown_links_resolve():
    bad = broken_links()
    assert not bad, "relative links to files that do not exist:\n" + "\n".join(bad)
