"""Property tests (hypothesis) for the decoders at the trust boundary: the `FaultEvent` wire schema,
the router's `decode_event`, and operator config files. No input crashes them; every rejection is
the one documented error type with a reason."""

from __future__ import annotations

import json
import string
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fleetmend.config import load_settings
from fleetmend.errors import ConfigError, InvalidEventError
from fleetmend.events import SCHEMA_VERSION, Component, Device, FaultEvent, Severity, Source
from fleetmend.router.core import MAX_EVENT_BYTES, decode_event

NAME = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=20)
KIND = st.text(alphabet=string.ascii_lowercase + string.digits + "_", min_size=1, max_size=30)
SMALL_TEXT = st.text(max_size=200)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | SMALL_TEXT,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(SMALL_TEXT, children, max_size=5),
    max_leaves=20)

devices = st.builds(Device, index=st.none() | st.integers(0, 15),
                    pci_bus_id=st.none() | st.from_regex(r"\A0000:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\Z"),
                    uuid=st.none() | st.uuids().map(lambda u: f"GPU-{u}"), serial=st.none() | SMALL_TEXT,
                    name=st.none() | NAME, port=st.none() | st.integers(1, 64))
events = st.builds(
    FaultEvent, cluster=NAME, node=NAME, component=st.sampled_from(Component), device=devices, kind=KIND,
    code=st.none() | st.integers(-(2**31), 2**31), severity=st.sampled_from(Severity), healthy=st.booleans(),
    message=st.text(max_size=300), source=st.sampled_from(Source), raw=st.text(max_size=2000),
    observed_at=st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1),
                             timezones=st.just(timezone.utc)),
    agent_version=st.text(max_size=20), pid=st.none() | st.integers(0, 2**22),
    attrs=st.dictionaries(NAME, st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=20),
                          max_size=4))


def subject_of(ev: FaultEvent) -> str:
    return f"fleet.{ev.cluster}.fault.{ev.node}"


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_event_round_trips_through_the_wire_and_the_router(ev: FaultEvent):
    data = ev.to_json_bytes()
    assert FaultEvent.from_json_bytes(data) == ev
    assert decode_event(subject_of(ev), data) == ev
    # unknown fields from a newer agent are tolerated
    newer = json.loads(data)
    newer["field_from_the_future"] = {"x": 1}
    assert decode_event(subject_of(ev), json.dumps(newer).encode()) == ev


def _decode_or_reason(subject: str, data: bytes) -> FaultEvent | None:
    try:
        return decode_event(subject, data)
    except InvalidEventError as err:
        assert err.reason and err.reason.strip(), "every rejection has a reason"
        assert len(str(err)) < 4000, "reasons stay readable"
        return None


@settings(max_examples=300)
@given(JSON)
def test_arbitrary_json_never_crashes_decode(obj):
    _decode_or_reason("fleet.c1.fault.n1", json.dumps(obj).encode())


@settings(max_examples=300)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_never_crash_decode(data: bytes):
    _decode_or_reason("fleet.c1.fault.n1", data)


@settings(max_examples=300)
@given(st.text(max_size=80))
def test_arbitrary_subject_never_crashes_decode(subject: str):
    ev = FaultEvent(cluster="c1", node="n1", component=Component.GPU, kind="xid", code=79,
                    severity=Severity.FATAL, source=Source.INJECT)
    got = _decode_or_reason(subject, ev.to_json_bytes())
    assert got is None or subject == "fleet.c1.fault.n1"


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(events, st.sampled_from(sorted(FaultEvent.model_fields)), JSON)
def test_any_field_replaced_by_any_json_is_valid_or_a_clear_rejection(ev: FaultEvent, field: str, value):
    obj = json.loads(ev.to_json_bytes())
    obj[field] = value
    got = _decode_or_reason(subject_of(ev), json.dumps(obj).encode())
    if got is not None:
        assert got.cluster == ev.cluster and got.node == ev.node


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(events, st.integers(1, 400))
def test_truncated_messages_are_rejected_with_a_reason(ev: FaultEvent, cut: int):
    data = ev.to_json_bytes()
    assume(cut < len(data))
    assert _decode_or_reason(subject_of(ev), data[:-cut]) is None


def test_wrong_schema_version_oversized_non_utf8_reasons():
    ev = FaultEvent(cluster="c1", node="n1", component=Component.GPU, kind="xid", code=79,
                    severity=Severity.FATAL, source=Source.INJECT)
    subject = subject_of(ev)
    for version in (0, SCHEMA_VERSION + 1, -5):
        obj = json.loads(ev.to_json_bytes())
        obj["schema_version"] = version
        with pytest.raises(InvalidEventError, match=f"schema_version {version}"):
            decode_event(subject, json.dumps(obj).encode())
    with pytest.raises(InvalidEventError, match="oversized"):
        decode_event(subject, ev.to_json_bytes() + b" " * MAX_EVENT_BYTES)
    with pytest.raises(InvalidEventError, match="not UTF-8 at byte 3"):
        decode_event(subject, b'{"a\xff": 1}')


# ------------------------------------------------------------------------------------- config

TOML_KEY = st.sampled_from(["cluster", "node", "nats_url", "scheduler", "log_format", "task_queue",
                            "nats_connect_timeout_s", "router", "agent", "policy", "tickets", "slurm", "nats_tls",
                            "temporal_tls", "state_dir"]) | NAME


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


TOML_SCALAR = (st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
               | st.text(max_size=40))
TOML_VALUE = st.recursive(TOML_SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(NAME, c, max_size=3),
                          max_leaves=8)


def _load(tmp_path: Path, content: bytes):
    p = tmp_path / "fleetmend.toml"
    p.write_bytes(content)
    try:
        return load_settings(p)
    except ConfigError as err:
        text = str(err)
        assert str(p) in text or "config file" in text, "the error names the file"
        return err


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.dictionaries(TOML_KEY, TOML_VALUE, max_size=6))
def test_arbitrary_toml_tables_load_or_raise_config_error(tmp_path: Path, table: dict):
    text = "\n".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items())
    _load(tmp_path, text.encode())


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_config_bytes_never_traceback(tmp_path: Path, content: bytes):
    _load(tmp_path, content)


def test_config_error_lists_every_error_at_once(tmp_path: Path):
    got = _load(tmp_path, b'cluster = "a.b"\nscheduler = "slrum"\nnats_connect_timeout_s = "soon"\n'
                          b'router = { fetch_batch = "x", typo_key = 1 }\n')
    assert isinstance(got, ConfigError)
    text = str(got)
    assert "(5 errors)" in text, text
    for where in ("cluster", "scheduler", "nats_connect_timeout_s", "router.fetch_batch", "router.typo_key"):
        assert f"  {where}:" in text, (where, text)
