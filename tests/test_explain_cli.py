"""`fleetmend explain` as a health check: exit statuses, --exit-zero, unreadable input, streaming of a
large input (the status and the faults of a file over the whole-read limit)."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetmend.cli import explain as ex

REPO = Path(__file__).resolve().parents[1]
TEXTS = REPO / "tests" / "crash_texts"
FATAL = (TEXTS / "mlx5_flower_oops.txt").read_text()  # an oops: fatal, drain
DEGRADED = ("[ 8112.112341] INFO: task kworker/u96:2:3481 blocked for more than 122 seconds.\n"
            "[ 8112.112399]       Not tainted 5.15.0-91-generic #101-Ubuntu\n")
INFO = "[    3.201000] pcieport 0000:00:01.0: AER: Corrected error received: 0000:01:00.0\n"
NOISE = (REPO / "tests" / "h200_boot_dmesg.txt").read_text()


def explain(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "explain", *args], input=stdin,
                          capture_output=True, cwd=REPO, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_degraded_text_is_what_the_statuses_below_rely_on() -> None:
    from agents.kmsg import parse_text

    assert [e.severity.value for e in parse_text(DEGRADED, node="n")] == ["degraded"]
    assert [e.severity.value for e in parse_text(INFO, node="n")] == ["info"]
    assert parse_text(NOISE, node="n") == []


@pytest.mark.parametrize(("text", "status"), [(NOISE, 0), (INFO, 0), (DEGRADED, 1), (FATAL, 2),
                                              (INFO + DEGRADED + FATAL, 2)])
def test_exit_status_follows_the_worst_finding(tmp_path: Path, text: str, status: int) -> None:
    f = tmp_path / "kern.log"
    f.write_text(text)
    p = explain(str(f))
    assert p.returncode == status, p.stderr
    p = explain("--json", "-", stdin=text.encode())
    assert p.returncode == status
    assert explain("--exit-zero", str(f)).returncode == 0


def test_unreadable_input_and_bad_usage_exit_3(tmp_path: Path) -> None:
    missing = explain(str(tmp_path / "nope.log"))
    assert missing.returncode == 3 and "no such file" in missing.stderr.decode()
    assert explain(str(tmp_path)).returncode == 3  # a directory
    gz = tmp_path / "kern.log.gz"
    gz.write_bytes(gzip.compress(FATAL.encode()))
    p = explain("--exit-zero", str(gz))
    assert p.returncode == 3 and "gzip-compressed" in p.stderr.decode()
    assert explain("--no-such-option").returncode == 3
    if os.geteuid() != 0:
        locked = tmp_path / "locked.log"
        locked.write_text(FATAL)
        locked.chmod(0)
        assert explain(str(locked)).returncode == 3


def test_help_documents_the_exit_statuses() -> None:
    out = explain("--help").stdout.decode()
    for line in ("0    nothing to act on", "1    the worst finding is degraded", "2    a fatal finding",
                 "3    the input could not be read", "--exit-zero"):
        assert line in out, out


def test_a_large_input_is_streamed_and_every_fault_found(tmp_path: Path, monkeypatch) -> None:
    """Over the whole-read limit the input is streamed as a kernel log; every planted fault is found.
    (Speed and memory of a 100 MB log: bench/explain_stream.py.)"""
    from agents.kmsg import parse_text

    planted = [FATAL, DEGRADED, INFO]
    want = sum(len(parse_text(t, node="n")) for t in planted)
    f = tmp_path / "big.log"
    with f.open("w") as out:
        while out.tell() < ex.WHOLE_MAX_BYTES + 2_000_000:
            out.write(NOISE)
            if out.tell() > 3_000_000 and planted:
                out.write("\n" + planted.pop(0) + "\n")
    p = explain("--json", str(f))
    assert p.returncode == 2, p.stderr
    found = [json.loads(x) for x in p.stdout.decode().splitlines()]
    assert len(found) == want and {x["severity"] for x in found} == {"fatal", "degraded", "info"}
    assert "streamed" in p.stderr.decode()
    run = ex.ExplainRun()
    with f.open("rb") as fh:
        assert len(list(ex.explain_stream(fh, run))) == want
    assert run.mode == "stream" and ex.exit_status(run) == ex.EXIT_FATAL


def test_binary_input_names_what_it_is_and_only_a_compressed_log_gets_a_decompressor(tmp_path: Path) -> None:
    cases = {"kern.log.gz": (gzip.compress(FATAL.encode()), "gzip-compressed", "zcat FILE"),
             "kern.log.zst": (b"\x28\xb5\x2f\xfd" + b"\x00" * 64, "zstd-compressed", "zstdcat FILE"),
             "core.bin": (b"\x7fELF\x02\x01\x01" + b"\x00" * 64, "binary data", None)}
    for name, (data, what, tool) in cases.items():
        f = tmp_path / name
        f.write_bytes(data)
        p = explain(str(f))
        msg = " ".join(p.stderr.decode().split())
        assert p.returncode == 3 and what in msg, (name, msg)
        assert (tool in msg) if tool else ("cat" not in msg), (name, msg)


def test_json_says_each_field_once() -> None:
    """The verdict's fields are the flat keys (severity, fault class, action, drain, description): not
    repeated inside a nested `verdict`."""
    rows = [json.loads(line) for line in explain("--json", "-", stdin=FATAL.encode()).stdout.decode().splitlines()]
    assert rows and all("verdict" not in r for r in rows)
    assert all({"fault_class", "immediate_action", "drain", "description", "severity"} <= set(r) for r in rows)


def test_no_file_on_a_terminal_says_so_instead_of_waiting() -> None:
    import pty

    leader, follower = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "explain"], stdin=follower,
                           capture_output=True, cwd=REPO, timeout=60, env={**os.environ, "COLUMNS": "200"})
    finally:
        os.close(follower)
        os.close(leader)
    assert p.returncode == 3 and "no input: give a file" in " ".join(p.stderr.decode().split())


def test_the_console_script_explains_without_the_server_clients(tmp_path: Path) -> None:
    """`fleetmend explain` (the console script's path) loads only its own command: none of nats-py, aiohttp,
    temporalio or the Kubernetes client (half of its start-up before), and answers exactly as the full app does
    (same JSON, exit status and help)."""
    log = tmp_path / "kern.log"
    log.write_text(NOISE[:20_000] + FATAL)
    entry = [sys.executable, "-X", "importtime", "-c", "from fleetmend.cli.entry import main; main()", "explain"]
    lean = subprocess.run([*entry, str(log), "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    full = explain(str(log), "--json")
    assert lean.returncode == full.returncode == 2, lean.stderr[-2000:]

    def events(text: str) -> list[dict]:  # ids are minted per run; an uptime stamp is read against now
        return [{k: v for k, v in json.loads(x).items() if k not in ("event_id", "observed_at")} for x in text.splitlines()]

    assert events(lean.stdout) == events(full.stdout.decode()) and events(lean.stdout)
    imported = {line.split("|")[-1].strip() for line in lean.stderr.splitlines() if line.startswith("import time:")}
    assert "fleetmend.catalog" in imported, "importtime lists nothing: the check below would prove nothing"
    assert not {"nats", "aiohttp", "temporalio", "kubernetes", "fleetmend.cli.app"} & imported
    helps = [subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60,
                            env={**os.environ, "COLUMNS": "100"}).stdout
             for cmd in ([*entry[:1], *entry[3:], "--help"],
                         [sys.executable, "-m", "fleetmend.cli.main", "explain", "--help"])]
    assert helps[0] == helps[1].replace("python -m fleetmend.cli.main", "fleetmend") and "Usage: fleetmend explain" in helps[0]


def _worst(text: str) -> str:
    xs = [x for x in ex.explain_text(text) if not x.event.healthy]
    return max((x.event.severity for x in xs), key=lambda s: s.rank).value if xs else "info"


def test_explain_reads_every_corpus_case_at_its_expected_severity() -> None:
    """The exit status follows the WORST finding of explain's own path (every parser, `parse_any`), so every
    corpus case (kernel logs and tool outputs alike) is judged that way here. tests/test_kmsg_corpus.py checks
    that SOME kernel-parser event matches and only that the other kinds do not crash: it passed while explain read
    m322 (one corrected MCE at boot) as degraded and m323 (ras-mc-ctl output) as fatal (try2 F21)."""
    from tests.corpus_paths import load_cases

    wrong = [(c["id"], _worst(c["raw"]), c["expected"]["severity"]) for c in load_cases()
             if _worst(c["raw"]) != c["expected"]["severity"]]
    assert wrong == []


def test_ras_mc_ctl_records_end_where_the_section_ends() -> None:
    """ras-mc-ctl's records are numbered (`--errors`) or indented (`--summary`); a line after them that is neither
    (the next pasted command, anything else) is no record: it was a fatal mce_uncorrected (try2 F21)."""
    summary = "MCE records summary:\n\t1 Corrected error, no action required. errors\n"
    for after in ("hello world\n", "sudo ras-mc-ctl --errors\n", "$ dmesg | tail\n"):
        got = [(x.event.kind, x.event.severity.value) for x in ex.explain_text(summary + after)]
        assert got == [("mce", "info")], after
    # the records of a section that follows still count
    text = summary + "sudo ras-mc-ctl --errors\nMCE events:\n1 .. error: Uncorrected error, CPU 2, bank 4\n"
    assert ("mce_uncorrected", "fatal") in [(x.event.kind, x.event.severity.value) for x in ex.explain_text(text)]


def test_a_corrected_overflowed_bank_found_at_boot_is_corrected_not_a_rate() -> None:
    """The CPU-online scan prints a bank kept across the reset; its OVER bit counts errors of the previous run
    (corpus m322: info). The same record later (CMCI, poll timer) is errors faster than they are read."""
    line = "[{t}] mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 17: dc2040000000011b\n"
    assert [e.kind for e in (x.event for x in ex.explain_text(line.format(t="    0.644337")))] == ["mce"]
    assert [e.kind for e in (x.event for x in ex.explain_text(line.format(t=" 5310.396113")))] == [
        "mce_corrected_repeated"]


XID79 = "[ 7123.000001] NVRM: Xid (PCI:0000:a1:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"


def test_nul_runs_left_by_a_crash_are_skipped_and_a_binary_file_still_refused(tmp_path: Path, monkeypatch) -> None:
    """A kern.log after a hard reset or power loss holds a zero-filled stretch (the unflushed tail): its NUL runs
    are line breaks, the log is read (it was refused as binary data, exit 3, hiding the XID 79: try2 F15)."""
    zero_fill = b"\x00" * 4096
    for data in (zero_fill + XID79.encode(),                                   # a zero-filled head
                 b"[ 7000.0] partial line cut by the res" + zero_fill + XID79.encode(),  # a run mid-line
                 XID79.encode() + b"abc\x00def\n"):                            # one NUL
        f = tmp_path / "kern.log"
        f.write_bytes(data)
        p = explain(str(f))
        assert p.returncode == 2, (data[:60], p.stderr)
        assert "XID 79" in p.stdout.decode() and "NUL byte(s) skipped" in p.stderr.decode()
    # streamed (over the whole-read limit): the same
    monkeypatch.setattr(ex, "WHOLE_MAX_BYTES", 64 * 1024)
    big = (NOISE.encode() * (1 + 200_000 // len(NOISE)))[:200_000] + zero_fill + XID79.encode()
    run = ex.ExplainRun()
    assert [(x.event.kind, x.event.code) for x in ex.explain_stream(io.BytesIO(big), run)] == [("xid", 79)]
    assert run.mode == "stream" and run.nul_bytes == 4096
    # binary data is still refused: an executable, random bytes
    import random

    rnd = random.Random(7).randbytes(100_000)
    for data in (Path(sys.executable).read_bytes()[:200_000], rnd if b"\x00" in rnd[:65536] else rnd + b"\x00",
                 XID79.encode("utf-16-le") * 20):  # UTF-16: NULs one by one, not a zero-filled run
        with pytest.raises(ex.UnreadableInput, match="binary data"):
            list(ex.explain_stream(io.BytesIO(data)))


@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_a_reader_that_goes_away_is_a_closed_pipe_not_a_degraded_finding(tmp_path: Path, fmt: list[str]) -> None:
    """`fleetmend explain big.log | head -1`: quiet, status 141 as a command killed by SIGPIPE (it was click's and
    rich's 1, which for explain means "degraded": try2 F4)."""
    f = tmp_path / "big.log"
    f.write_text(XID79.replace("79", "31") * 5 + "".join(
        f"[ {7200 + i}.0] NVRM: Xid (PCI:0000:{i % 200:02x}:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
        for i in range(3000)))
    p = subprocess.Popen([sys.executable, "-m", "fleetmend.cli.main", "explain", *fmt, str(f)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "200"})
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline()
    p.stdout.close()
    assert p.wait(timeout=120) == ex.EXIT_STDOUT_CLOSED == 141
    assert p.stderr.read().decode().strip() == ""


def test_a_fault_repeating_past_the_record_cap_is_one_fault_in_parts(tmp_path: Path) -> None:
    """The parser reports a long run of one fault in parts of MAX_RECORD_LINES (a record must close for the agent
    to publish it); the parts after the first say they continue it and count as no further fault (1000 repeats of
    one XID 79 read "3 fault(s): 3 fatal", three identical rows of "400 times": try2 F3)."""
    from agents.kmsg.parser import MAX_RECORD_LINES

    f = tmp_path / "n.log"
    f.write_text(XID79 * 1000)
    run = ex.ExplainRun()
    with f.open("rb") as fh:
        xs = list(ex.explain_stream(fh, run))
    assert [(x.event.attrs["count"], bool(x.event.attrs.get("continued"))) for x in xs] == [
        (MAX_RECORD_LINES, False), (MAX_RECORD_LINES, True), (1000 - 2 * MAX_RECORD_LINES, True)]
    assert run.total == 1 and run.counts == {"fatal": 1} and run.continued == 2
    p = explain(str(f))
    assert p.returncode == 2 and "1 fault(s): 1 fatal (+2 continuation row(s)" in p.stdout.decode()
    assert p.stdout.decode().count("more time(s) (the same fault, continued)") == 2
    # two faults of one kind stay two
    two = XID79 * 3 + XID79.replace("a1:00", "b1:00")
    assert ex.exit_status(run) == 2 and len(ex.explain_text(two)) == 2
