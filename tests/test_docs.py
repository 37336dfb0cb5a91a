"""The guides in docs/ quote code from the sources by markers: every marker must exist and every
quote must match the current source (refresh with `python tools/docs_quotes.py --write`)."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quotes_match_sources():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "docs_quotes.py")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_every_guide_quotes_code_and_is_indexed():
    index = (ROOT / "docs" / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        if doc.name == "README.md":
            continue
        assert "<!-- quote:" in doc.read_text(), f"{doc.name} quotes no code"
        assert f"({doc.name})" in index, f"{doc.name} is not linked from docs/README.md"


def test_checker_reports_a_missing_marker(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import docs_quotes

    doc = ROOT / "docs" / "_probe_missing_marker.md"
    doc.write_text("<!-- quote: csrc/ops/minimal_ops.cpp NO_SUCH_MARKER -->\n```cpp\nx\n```\n")
    try:
        problems = docs_quotes.process(doc, write=False)
    finally:
        doc.unlink()
    assert problems and "NO_SUCH_MARKER" in problems[0]
