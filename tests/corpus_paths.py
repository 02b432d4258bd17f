"""Where the decoder tests' corpus lives: `tests/corpus/` in the repository, so a fresh clone tests with
nothing beside it.

Files: `cases.jsonl` and `cases-new.jsonl` (real fault texts with operator readings), `cases-more.jsonl`
(further real texts found in public issue trackers, mailing lists and driver sources, each with its
source). NVIDIA's XID tables the catalog generator reads are product data, not corpus: they live in
`fleetmend/catalog/source/`. `$FLEETMEND_CORPUS` points the tests at another
directory with the same layout; its missing files are then simply absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CASE_FILES = ("cases.jsonl", "cases-new.jsonl", "cases-more.jsonl")


def corpus_dir() -> Path:
    """`$FLEETMEND_CORPUS`, else `tests/corpus` of this checkout."""
    env = os.environ.get("FLEETMEND_CORPUS")
    return Path(env) if env else Path(__file__).resolve().parent / "corpus"


def load_cases(kind: str | None = None) -> list[dict]:
    """Cases from every case file (optionally of one `kind`). Raises RuntimeError when none is found."""
    d = corpus_dir()
    cases: list[dict] = []
    for name in CASE_FILES:
        path = d / name
        if path.exists():
            cases += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not cases:
        raise RuntimeError(f"no corpus cases under {d} (tests/corpus is part of the repository)")
    ids = [c["id"] for c in cases]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise RuntimeError(f"duplicate corpus case ids: {dupes}")
    return [c for c in cases if kind is None or c["kind"] == kind]


def need_corpus() -> Path:
    """The corpus dir (always present in the repository)."""
    d = corpus_dir()
    if not (d / "cases.jsonl").exists():
        raise RuntimeError(f"corpus missing at {d}")
    return d


def corpus_case(case_id: str) -> dict:
    """One case by id (e.g. "c005")."""
    for c in load_cases():
        if c["id"] == case_id:
            return c
    raise KeyError(f"no corpus case {case_id} in {corpus_dir()}")
