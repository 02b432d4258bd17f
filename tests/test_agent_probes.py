"""Probe registry and config: which probes an agent runs, and a live agent with every probe on
against the real nats-server (on this GPU-less host NVML yields one nvml_unavailable and goes quiet)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agents.probes import HARDWARE_PROBES, PROBES, build_probes, probe_class
from agents.runner import run_agent
from fleetmend.config import AgentSettings, Settings, load_settings
from fleetmend.errors import ConfigError
from fleetmend.events import FaultEvent
from fleetmend.infra.jetstream import ensure_fault_stream
from fleetmend.subjects import fault_subject, heartbeat_subject
from tests.conftest import assert_eventually


def test_registry_names_every_probe() -> None:
    assert set(PROBES) >= {"kmsg", "nvml", "sysfs", "udev", "inject"}
    for name in PROBES:
        assert probe_class(name).name == name
    with pytest.raises(KeyError, match="expected inject, inventory, kmsg, lastboot, nvml, sysfs, udev"):
        probe_class("nvlm")


def test_build_probes_follows_the_enable_flags(tmp_path: Path) -> None:
    s = Settings(node="n1", agent=AgentSettings(kmsg_path=tmp_path / "k", nvml_poll_interval_s=5,
                                                sysfs_root=tmp_path, udev_source="kernel"))
    probes = {p.name: p for p in build_probes(s)}
    assert list(probes) == ["kmsg", *HARDWARE_PROBES, "inventory"]
    assert probes["nvml"].poll_interval_s == 5 and probes["sysfs"].root == tmp_path
    assert probes["udev"].source == "kernel"
    off = s.model_copy(update={"agent": s.agent.model_copy(update={"nvml": s.agent.nvml.model_copy(
        update={"enabled": False}), "udev": s.agent.udev.model_copy(update={"enabled": False})})})
    assert [p.name for p in build_probes(off)] == ["kmsg", "sysfs", "lastboot", "inventory"]
    flat = Settings(node="n1", agent=AgentSettings(kmsg_path=tmp_path / "k", nvml_enabled=False,
                                                   udev={"enabled": False}))  # old flat key and new section
    assert [p.name for p in build_probes(flat)] == ["kmsg", "sysfs", "lastboot", "inventory"]
    assert [p.name for p in build_probes(s, hardware=False)] == ["kmsg"]


def test_bad_udev_source_fails_at_startup(monkeypatch) -> None:
    monkeypatch.setenv("FLEETMEND_AGENT__UDEV_SOURCE", "udevd")
    with pytest.raises(ConfigError, match="expected auto, udev, kernel"):
        load_settings(None)


def test_flat_probe_keys_land_in_their_section(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLEETMEND_AGENT__LASTBOOT_ENABLED", "false")  # flat spelling of earlier releases
    monkeypatch.setenv("FLEETMEND_AGENT__SYSFS__ROOT", str(tmp_path))  # sectioned spelling
    s = load_settings(None, node="n1")
    assert s.agent.lastboot.enabled is False and s.agent.sysfs.root == tmp_path
    assert "lastboot" not in [p.name for p in build_probes(s)]
    monkeypatch.setenv("FLEETMEND_AGENT__LASTBOOT__ENABLED", "true")
    with pytest.raises(ConfigError, match="agent.lastboot_enabled and agent.lastboot.enabled are the same setting"):
        load_settings(None)


async def test_live_agent_runs_every_probe_and_nvml_reports_once(nats_server, nc, unique: str,
                                                                  tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    (tmp_path / "kmsg").write_text("")
    s = Settings(cluster=cluster, node=node, nats_url=nats_server.url, state_dir=tmp_path / "state",
                 agent=AgentSettings(nice=0, heartbeat_interval_s=0.2, kmsg_path=tmp_path / "kmsg",
                                     nvml_retry_interval_s=0.05, sysfs_root=tmp_path, sysfs_poll_interval_s=0.05,
                                     host_root=tmp_path))
    beats: list[dict] = []

    async def on_hb(msg) -> None:
        beats.append(json.loads(msg.data))

    await nc.subscribe(heartbeat_subject(cluster, node), cb=on_hb)
    js = nc.jetstream()
    await ensure_fault_stream(js)
    stop = asyncio.Event()
    agent = asyncio.create_task(run_agent(s, stop=stop))
    try:
        hb = await assert_eventually(lambda: beats and set(beats[-1]["probes"]) == {"kmsg", *HARDWARE_PROBES, "inventory"}
                                     and beats[-1], timeout_s=20, what="heartbeat naming every probe")
        assert hb["probes"]["sysfs"] == "ok" and hb["probes"]["nvml"] == "ok"
        sub = await js.subscribe(fault_subject(cluster, node), ordered_consumer=True)
        msg = await sub.next_msg(timeout=10)
        ev = FaultEvent.from_json_bytes(msg.data)
        await asyncio.sleep(0.5)  # ~10 nvmlInit retries: none may publish again
        with pytest.raises(Exception):  # noqa: B017 - nats TimeoutError: nothing more
            await sub.next_msg(timeout=0.5)
    finally:
        stop.set()
        assert await asyncio.wait_for(agent, 15) == 0
    if ev.kind != "nvml_unavailable":
        pytest.skip("this host has a working NVML")
    assert ev.component.value == "agent" and ev.severity.value == "info" and ev.source.value == "nvml"


async def test_agent_on_a_host_without_nvidia_gpus_reports_nvml_not_applicable(nats_server, nc, unique: str,
                                                                                tmp_path: Path) -> None:
    """Issue 30: `dev up` on a GPU-less box opened an incident for the host itself (`nvml_unavailable`). With the
    host root's PCI bus showing no NVIDIA GPU, the heartbeat says "not applicable" and nothing is published."""
    cluster, node = f"c{unique}", "n1"
    (tmp_path / "kmsg").write_text("")
    nic = tmp_path / "host/sys/bus/pci/devices/0000:3b:00.0"
    nic.mkdir(parents=True)
    (nic / "vendor").write_text("0x8086\n")
    (nic / "class").write_text("0x020000\n")
    s = Settings(cluster=cluster, node=node, nats_url=nats_server.url, state_dir=tmp_path / "state",
                 agent=AgentSettings(nice=0, heartbeat_interval_s=0.2, kmsg_path=tmp_path / "kmsg",
                                     nvml_retry_interval_s=0.05, sysfs_root=tmp_path / "host",
                                     host_root=tmp_path / "host", inventory_enabled=False,
                                     lastboot={"enabled": False}, udev={"enabled": False}))
    beats: list[dict] = []

    async def on_hb(msg) -> None:
        beats.append(json.loads(msg.data))

    await nc.subscribe(heartbeat_subject(cluster, node), cb=on_hb)
    js = nc.jetstream()
    await ensure_fault_stream(js)
    sub = await js.subscribe(fault_subject(cluster, node), ordered_consumer=True)
    stop = asyncio.Event()
    agent = asyncio.create_task(run_agent(s, stop=stop, hardware=True))
    try:
        hb = await assert_eventually(lambda: beats and beats[-1]["probes"].get("nvml", "").startswith("not applicable")
                                     and beats[-1], timeout_s=20, what="nvml not applicable in the heartbeat")
        assert "no NVIDIA GPU on the PCI bus" in hb["probes"]["nvml"]
        with pytest.raises(Exception):  # noqa: B017 - nats TimeoutError: nothing published
            await sub.next_msg(timeout=1.0)
    finally:
        stop.set()
        assert await asyncio.wait_for(agent, 15) == 0
