"""The documents hold: generated reference pages are up to date, every backticked path and dotted
name in README.md and docs/*.md resolves, the README and the bench results stay short, and nothing
in the repository points at the notes folder of the sessions, which a user does not have."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

from fleetmend.dev.refdocs import REGEN, registered_metrics, render_all
from fleetmend.infra import metrics

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

TOP_FOLDERS = ("fleetmend", "agents", "activities", "workflows", "tests", "deploy", "bench", "scripts", "docs", ".ci")
"""A backticked token containing `/` is checked as a path when its first part is one of these."""
PACKAGES = ("fleetmend", "agents", "activities", "workflows", "bench", "tests")
"""A backticked dotted token is checked as a module or attribute when it starts with one of these."""

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^(?:\./)?(?P<top>[\w.-]+)/[\w./*<>{}-]*$")
_DOTTED = re.compile(r"^(?P<top>[A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)+$")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def tokens(text: str) -> list[str]:
    """Words of inline code spans (fenced blocks left out: they hold commands and captures)."""
    out = []
    for span in _SPAN.findall(_FENCE.sub("", text)):
        out += span.split()
    return out


def _strip(word: str) -> str:
    word = word.strip(",;:()[]")
    word = re.sub(r":\d+(?:-\d+)?$", "", word)  # file.py:42 (a line)
    return word.removesuffix("()")


def check_path(word: str, root: Path = REPO) -> str | None:
    """None if `word` is no project path or names something that exists; else why not."""
    m = _PATH.match(word)
    if not m or m["top"] not in TOP_FOLDERS:
        return None
    rel = word.removeprefix("./").rstrip("/")
    pattern = re.sub(r"<[^>]*>|\{[^}]*\}", "*", rel)
    if "*" in pattern:
        return None if any(root.glob(pattern)) else f"{word}: no file matches"
    return None if (root / rel).exists() else f"{word}: no such file or folder"


def check_name(word: str) -> str | None:
    """None if `word` is no project name or imports; else why not. The longest importable prefix is
    imported, the rest looked up attribute by attribute."""
    m = _DOTTED.match(word)
    if not m or m["top"] not in PACKAGES:
        return None
    parts = word.split(".")
    obj = None
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name and (name == err.name or name.startswith(err.name + ".")):
                continue  # this prefix is no module: try a shorter one
            raise
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{word}: {type(obj).__name__} {'.'.join(parts[:parts.index(attr)])} has no {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"{word}: no such module"


def broken_references(text: str, root: Path = REPO) -> list[str]:
    found = []
    for word in map(_strip, tokens(text)):
        why = check_path(word, root) if "/" in word else check_name(word)
        if why:
            found.append(why)
    return found


# ---------------------------------------------------------------- generated pages


def test_generated_reference_pages_are_up_to_date() -> None:
    stale = [name for name, text in render_all().items()
             if not (DOCS / name).exists() or (DOCS / name).read_text() != text]
    assert not stale, f"out of date: {stale}; regenerate with `{REGEN}`"


def test_every_metric_says_who_sets_it() -> None:
    from fleetmend.dev.refdocs import exposed_name

    names = {exposed_name(m) for m in registered_metrics()}
    assert "fleetmend_time_to_quarantine_seconds" in names and "fleetmend_fleet_gauges_publisher" in names
    assert not names - set(metrics.SET_BY), f"no SET_BY entry: {sorted(names - set(metrics.SET_BY))}"
    assert not set(metrics.SET_BY) - names, f"SET_BY names no metric: {sorted(set(metrics.SET_BY) - names)}"


def test_configuration_page_lists_every_setting() -> None:
    text = (DOCS / "configuration.md").read_text()
    for key, env in (("policy.permit_reconcile_s", "FLEETMEND_POLICY__PERMIT_RECONCILE_S"), ("agent.nvml.enabled",
                     "FLEETMEND_AGENT__NVML__ENABLED"), ("nats_url", "FLEETMEND_NATS_URL")):
        assert f"| `{key}` | `{env}` |" in text
    assert "|  |\n" not in text, "a setting without a docstring in fleetmend/config.py"


# ---------------------------------------------------------------- references resolve


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_backticked_paths_and_names_resolve(doc: Path) -> None:
    broken = broken_references(doc.read_text())
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path) -> None:
    links = [t for t in _LINK.findall(_FENCE.sub("", doc.read_text())) if not re.match(r"^[a-z]+:", t)]
    broken = [t for t in links if not (doc.parent / t).exists()]
    assert not broken, f"{doc.relative_to(REPO)}: broken links {broken}"


def test_the_checker_catches_a_broken_path_and_a_broken_name(tmp_path: Path) -> None:
    text = ("See `fleetmend/infra/lease.py`, `fleetmend.infra.lease.KvLease`, `agents.kmsg.parser`, "
            "`fleetmend.diagnostics.recovery_steps()`, `docs/runbooks/<class>.md`, `fleetmend/subjects.py:42`, "
            "`python -m fleetmend.catalog.runbooks docs/runbooks`.\n"
            "Not checked: `policy.drain_budget`, `fleet.<cluster>.fault.<node>`, `fleetmend.io/fault`, `/dev/kmsg`.\n"
            "```\nfleetmend/not/here.py inside a fence is a capture\n```\n")
    assert broken_references(text) == []
    bad = "`fleetmend/infra/leases.py` `fleetmend.catalog.Recovery.steps` `agents.kmsg.parsers` `deploy/helm/nope/`"
    found = broken_references(bad)
    assert len(found) == 4, found
    assert "fleetmend/infra/leases.py: no such file or folder" in found
    assert any(f.startswith("fleetmend.catalog.Recovery.steps:") and "'steps'" in f for f in found)
    assert any(f.startswith("agents.kmsg.parsers:") for f in found)


# ---------------------------------------------------------------- sizes and the two commands


def test_readme_is_for_operators_and_short() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode())} bytes; at most 12 KiB (move it to docs/)"
    assert "./scripts/dev-up" in text and "./scripts/test" in text
    order = ["what it will do to your nodes", "try it", "install", "everyday commands", "read more"]
    heads = [h.lower() for h in re.findall(r"^## (.+)$", text, re.M)]
    at = [next(i for i, h in enumerate(heads) if want in h) for want in order]
    assert at == sorted(at), heads


def test_bench_results_hold_current_figures_only() -> None:
    size = len((REPO / "bench" / "RESULTS.md").read_bytes())
    assert size <= 25 * 1024, f"bench/RESULTS.md is {size} bytes; at most 25 KiB (history stays in git)"


def test_nothing_refers_to_a_shared_folder() -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    needle = re.compile(r"(?<![\w-])" + "shared" + r"/")  # "work-shared/" in a corpus log line is data
    hits = []
    for rel in filter(None, files.split("\0")):
        if rel.startswith("tests/corpus/") or not (REPO / rel).is_file():
            continue
        try:
            text = (REPO / rel).read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{rel}:{n}" for n, line in enumerate(text.splitlines(), 1) if needle.search(line)]
    assert not hits, f"references to a notes folder users do not have: {hits}"
