"""Where the shared corpus lives for the decoder tests (kept beside the repo as ../shared/corpus)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def corpus_dir() -> Path:
    """`$FLEETMEND_CORPUS`, else `<repo>/../shared/corpus`."""
    env = os.environ.get("FLEETMEND_CORPUS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "corpus"


def load_cases(kind: str | None = None) -> list[dict]:
    """Cases from cases.jsonl (optionally of one `kind`). Missing corpus: fail under CI=true, else []."""
    path = corpus_dir() / "cases.jsonl"
    if not path.exists():
        if os.environ.get("CI", "").lower() == "true":
            raise RuntimeError(f"corpus missing at {path}: set FLEETMEND_CORPUS or lay shared/ beside the repo")
        return []
    cases = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [c for c in cases if kind is None or c["kind"] == kind]


def need_corpus() -> Path:
    """The corpus dir, or skip (fail under CI=true) when it is absent."""
    d = corpus_dir()
    if not (d / "cases.jsonl").exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"corpus missing at {d} (CI=true)")
        pytest.skip(f"corpus not found at {d}")
    return d


def corpus_case(case_id: str) -> dict:
    """One case by id (e.g. "c005"); skips (fails under CI=true) when the corpus is absent."""
    need_corpus()
    for c in load_cases():
        if c["id"] == case_id:
            return c
    raise KeyError(f"no corpus case {case_id} in {corpus_dir()}")
