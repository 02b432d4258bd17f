"""Access to the shared corpus of real hardware fault text (`../shared/corpus/`)."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest


def corpus_dir() -> Path:
    """`$FLEETMEND_CORPUS`, else `shared/corpus` beside the checkout (where CI lays it)."""
    env = os.environ.get("FLEETMEND_CORPUS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "corpus"


@cache
def corpus_cases() -> list[dict]:
    path = corpus_dir() / "cases.jsonl"
    if not path.exists():
        msg = f"corpus not found at {path}; set FLEETMEND_CORPUS"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def corpus_case(case_id: str) -> dict:
    for c in corpus_cases():
        if c["id"] == case_id:
            return c
    raise KeyError(f"no corpus case {case_id}")
