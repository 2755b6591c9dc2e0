"""bench/results/README.md indexes every record in bench/results/.

Each file there (records, test logs, raw data) is named exactly once in the index, as a current
record or as superseded, and every record name in the index is a file that exists. A record added
without a line in the index fails here.
"""

from __future__ import annotations

import os
import re

RESULTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results"))
INDEX = os.path.join(RESULTS, "README.md")

# A dated file name as the index writes it: 2026-12-05-per-request-h200.md, ...-run3.jsonl, ...
NAME = re.compile(r"(?<![\w./-])(\d{4}-\d{2}-\d{2}-[\w.-]*\w)(?![\w/-])")


def index_names() -> list[str]:
    with open(INDEX, encoding="utf-8") as f:
        return NAME.findall(f.read())


def records() -> list[str]:
    return sorted(e.name for e in os.scandir(RESULTS) if e.is_file() and e.name != "README.md")


def test_every_record_is_named_in_the_index_exactly_once():
    named = index_names()
    missing = [r for r in records() if r not in named]
    repeated = sorted({r for r in records() if named.count(r) > 1})
    assert not missing, f"bench/results/README.md does not name: {missing}"
    assert not repeated, f"bench/results/README.md names more than once: {repeated}"


def test_every_record_the_index_names_exists():
    present = set(records())
    absent = sorted({n for n in index_names() if n not in present})
    assert not absent, (
        f"bench/results/README.md names files that are not in bench/results/: {absent}"
    )
