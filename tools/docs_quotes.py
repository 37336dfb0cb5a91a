"""Keeps the code quoted in docs/ identical to the sources it comes from.

A guide quotes code with a marker comment followed by a fenced block:

    <!-- quote: csrc/ops/minimal_ops.cpp EMPTY.MEMORY_FORMAT -->
    ```cpp
    ...
    ```

and the source brackets the quoted region with `[docs:start NAME]` / `[docs:end NAME]` comments
(`//` in C++, `#` in Python and YAML). `python tools/docs_quotes.py --write` refreshes every quoted
block; `--check` (run by tests/test_docs.py) fails when a marker is missing or a quote is stale.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUOTE = re.compile(r"<!-- quote: (?P<path>\S+) (?P<name>\S+) -->\n```(?P<lang>\w*)\n(?P<body>.*?)```",
                   re.S)


def extract(path: str, name: str) -> str:
    """The lines between the start and end markers of `name` in `path`, dedented."""
    source = ROOT / path
    if not source.exists():
        raise LookupError(f"{path}: file not found")
    lines = source.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if re.search(rf"\[docs:start {re.escape(name)}\]", line)]
    ends = [i for i, line in enumerate(lines) if re.search(rf"\[docs:end {re.escape(name)}\]", line)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] <= starts[0]:
        raise LookupError(f"{path}: marker {name} missing or not unique")
    body = lines[starts[0] + 1 : ends[0]]
    indent = min((len(l) - len(l.lstrip()) for l in body if l.strip()), default=0)
    return "\n".join(l[indent:] for l in body) + "\n"


def process(doc: pathlib.Path, write: bool) -> list[str]:
    text = doc.read_text()
    problems: list[str] = []

    def replace(m: re.Match) -> str:
        try:
            body = extract(m["path"], m["name"])
        except LookupError as e:
            problems.append(f"{doc.relative_to(ROOT)}: {e}")
            return m[0]
        if body != m["body"]:
            problems.append(f"{doc.relative_to(ROOT)}: quote of {m['path']} {m['name']} is stale")
        return f"<!-- quote: {m['path']} {m['name']} -->\n```{m['lang']}\n{body}```"

    new = QUOTE.sub(replace, text)
    if write and new != text:
        doc.write_text(new)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="refresh quoted blocks in place")
    args = parser.parse_args()
    problems = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        problems += process(doc, args.write)
    if args.write:
        problems = [p for p in problems if not p.endswith("is stale")]
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
