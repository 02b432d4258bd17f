"""Node names of any shape (Kubernetes RFC 1123 subdomains, dotted Slurm names) and their one
reversible subject-token encoding (`fleetmend.subjects.node_token` / `token_node`)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetmend.subjects import NODE_NAME_MAX, check_node_name, node_token, token_node

# A NATS subject token: no '.', '*', '>' or whitespace; a JetStream KV key: [-/_=.a-zA-Z0-9].
_NATS_TOKEN_FORBIDDEN = re.compile(r"[.*>\s]")
_KV_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")

# RFC 1123 subdomain (what Kubernetes accepts as a node name), at most 253 characters.
_label = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?\Z")
rfc1123 = st.lists(_label, min_size=1, max_size=12).map(".".join).filter(lambda s: len(s) <= 253)
# Anything the contract accepts: printable, no whitespace, quote, path separator or hostlist syntax, 1-253 bytes.
any_name = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp", "Co", "Cn")),
                   min_size=1, max_size=NODE_NAME_MAX).filter(
    lambda s: s.isprintable() and not any(c.isspace() or c in "/\\'\"`[]," for c in s) and s not in (".", "..")
    and len(s.encode()) <= NODE_NAME_MAX)


@given(rfc1123)
def test_kubernetes_names_round_trip_and_make_valid_tokens(name: str) -> None:
    tok = node_token(name)
    assert token_node(tok) == name
    assert not _NATS_TOKEN_FORBIDDEN.search(tok)
    assert _KV_KEY.match(tok)


@settings(max_examples=300)
@given(any_name)
def test_any_accepted_name_round_trips(name: str) -> None:
    tok = node_token(name)
    assert token_node(tok) == name
    assert re.fullmatch(r"[A-Za-z0-9_=-]+", tok)


@given(any_name, any_name)
def test_distinct_names_have_distinct_tokens(a: str, b: str) -> None:
    assert (node_token(a) == node_token(b)) == (a == b)


@given(st.from_regex(r"\A[A-Za-z0-9_-]{1,64}\Z"))
def test_plain_names_are_their_own_token(name: str) -> None:
    # subjects, credentials and KV keys of existing nodes do not change
    assert node_token(name) == name


def test_examples() -> None:
    assert node_token("ip-10-0-1-23.ec2.internal") == "ip-10-0-1-23=2Eec2=2Einternal"
    assert node_token("gpu.rack1-07") == "gpu=2Erack1-07"
    assert node_token("a=b") == "a=3Db"
    assert token_node("gpu=2Erack1-07") == "gpu.rack1-07"
    n = "a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61
    assert len(n) == 253 and token_node(node_token(n)) == n


@pytest.mark.parametrize("bad", ["", " ", "a b", "node\n1", "x\t", "\x00", "a" * 254, "../etc", "a/b", "a\\b", "..", "a'b", 'a"b',
                                 "gpu[01-64]", "node1,node2", "a]"])
def test_bad_names_are_refused_with_a_reason(bad: str) -> None:
    with pytest.raises(ValueError, match="node name"):
        node_token(bad)
    with pytest.raises(ValueError):
        check_node_name(bad)


@pytest.mark.parametrize("bad", ["", "a.b", "a*", "a>", "a b", "=2e", "=2", "=ZZ", "a=2Db", "=41", "=FF", "=C3"])
def test_non_canonical_or_invalid_tokens_are_refused(bad: str) -> None:
    # '=2D' is an escaped '-', which is never escaped; '=41' is 'A'; '=FF' / '=C3' are not UTF-8
    with pytest.raises(ValueError, match="node token"):
        token_node(bad)


@given(st.text(min_size=1, max_size=40))
def test_decoding_any_text_either_fails_cleanly_or_round_trips(text: str) -> None:
    try:
        name = token_node(text)
    except ValueError:
        return
    assert node_token(name) == text


def test_subjects_keys_and_ids_carry_any_node_name() -> None:
    from fleetmend import subjects as sj

    n = "ip-10-0-1-23.ec2.internal"
    assert sj.fault_subject("prod", n) == "fleet.prod.fault.ip-10-0-1-23=2Eec2=2Einternal"
    assert sj.parse_fault_subject(sj.fault_subject("prod", n)) == ("prod", n)
    assert sj.parse_heartbeat_subject(sj.heartbeat_subject("prod", n)) == ("prod", n)
    assert sj.diag_subject("prod", n).count(".") == 3
    assert sj.inbox_prefix("prod", n) == "_INBOX.prod.ip-10-0-1-23=2Eec2=2Einternal"
    assert sj.workflow_id("prod", n) == f"remediate/prod/{n}"
    assert sj.parse_workflow_id(sj.workflow_id("prod", n)) == ("prod", n)
    assert sj.drain_kv_key("a", n) != sj.drain_kv_key("b", n)
    assert sj.parse_drain_kv_key(sj.drain_kv_key("b", n)) == ("b", n)
    assert _KV_KEY.match(sj.drain_kv_key("b", n))
    with pytest.raises(ValueError, match="not canonical"):
        sj.parse_fault_subject("fleet.prod.fault.node=2D1")
    with pytest.raises(ValueError):
        sj.fault_subject("prod.x", n)


def test_perf_samples_of_a_dotted_node() -> None:
    from fleetmend import subjects as sj
    from fleetmend.telemetry import PerfSample

    n = "ip-10-0-1-23.ec2.internal"
    assert sj.parse_perf_subject(sj.perf_subject("prod", n)) == ("prod", n)
    assert PerfSample(cluster="prod", node=n, interval_s=1.0).node == n
