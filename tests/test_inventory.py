"""The fingerprint reader over synthesised host roots (tests/fixtures/hosts/synth.py, kernel-documented formats)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.inventory import device_signature, read_fingerprint
from agents.inventory.pci import acs_source_validation, payload_sizes
from fleetmend.fingerprint import DeviceRole, Fingerprint, TopoLevel, fingerprint_change
from tests.fixtures.hosts.synth import HostSpec, build_host, config_space


def _fp(tmp_path: Path, spec: HostSpec | None = None, name: str = "n1") -> Fingerprint:
    return read_fingerprint(build_host(tmp_path / name, spec), "local", name)


def test_hardware_class_versions_and_placement(tmp_path: Path) -> None:
    fp = _fp(tmp_path)
    hw = fp.hardware
    assert (hw.gpu_model, hw.gpu_count, hw.board, hw.cpu_sockets) == ("NVIDIA H100 80GB HBM3", 8, "DGXH100", 2)
    assert hw.cpu_model == "Intel(R) Xeon(R) Platinum 8480C" and hw.hca_models == ["MT_0000000838"]
    assert fp.versions == {"nvidia_driver": "550.90.07", "ofed": "24.04-0.6.6", "kernel": "5.15.0-107-generic",
                           "bios": "1.5.0", "vbios": "96.00.74.00.0B", "hca_fw": "28.39.1002"}
    g0 = fp.gpus[0]
    assert (g0.pci_bus_id, g0.numa_node, g0.nearest_nic, g0.nic_level) == ("0000:1b:00.0", 0, "0000:1c:00.0",
                                                                         TopoLevel.PIX)
    assert (g0.nearest_nvme, g0.nvme_level) == ("0000:1d:00.0", TopoLevel.PIX)
    # GPU 1 has no NVMe under its switch: the nearest is GPU 0's, across host bridges of NUMA node 0
    assert (fp.gpus[1].nearest_nvme, fp.gpus[1].nvme_level) == ("0000:1d:00.0", TopoLevel.NODE)
    roles = {n.pci_bus_id: n.role for n in fp.nics}
    assert roles["0000:0a:00.0"] is DeviceRole.MANAGEMENT  # carries the default route, no GPU near
    assert [r for b, r in roles.items() if b != "0000:0a:00.0"] == [DeviceRole.COMPUTE] * 8
    assert len(fp.topology_hash) == 16


def test_settings_of_a_good_node(tmp_path: Path) -> None:
    s = _fp(tmp_path).settings
    assert s["gpudirect.peermem"] == "loaded" and s["pcie.acs"] == "off" and s["iommu.mode"] == "pt"
    assert s["cpu.governor"] == "performance" and s["kernel.numa_balancing"] == "0"
    assert s["mm.thp_enabled"] == "never" and s["mm.thp_defrag"] == "madvise"
    assert s["cpu.isolated"] == "none" and s["cpu.nohz_full"] == "none" and s["cgroup.system_cpus"] == "0-1"
    assert s["irq.affinity.compute.0000:1c:00.0"] == "local"
    assert s["pcie.link.compute.0000:1c:00.0"] == "32.0 GT/s x16 (max 32.0 GT/s x16)"
    assert s["pcie.link.gpu.0000:1b:00.0"] == "max 32.0 GT/s x16"  # GPUs downtrain at idle: only max
    assert s["pcie.payload.compute.0000:1c:00.0"] == "MaxPayload 256 MaxReadReq 4096"
    assert s["ib.compute.mlx5_0.1.rate"] == "400 Gb/sec (4X NDR)" and s["ib.compute.mlx5_0.1.state"] == "4: ACTIVE"
    assert s["net.compute.ibp28s0.mtu"] == "4092" and s["net.management.eno1.mtu"] == "1500"


def test_misconfigured_node_reads_what_is_wrong(tmp_path: Path) -> None:
    spec = HostSpec(governor="powersave", peermem=False, numa_balancing="1", thp="always",
                    acs_on=("0000:19:00.0", "0000:9b:00.0"), iommu_type="DMA-FQ", irq_off_node=True, nic_link_width=8)
    s = _fp(tmp_path, spec).settings
    assert s["cpu.governor"] == "powersave" and s["gpudirect.peermem"] == "absent"
    assert s["kernel.numa_balancing"] == "1" and s["mm.thp_enabled"] == "always"
    assert s["pcie.acs"] == "on:0000:19:00.0,0000:9b:00.0"
    assert s["iommu.mode"] == "translated"
    assert s["irq.affinity.compute.0000:1c:00.0"] == "off-node:2/2"
    assert s["pcie.link.compute.0000:1c:00.0"] == "32.0 GT/s x8 (max 32.0 GT/s x16)"


def test_mixed_governor_and_far_nic(tmp_path: Path) -> None:
    fp = _fp(tmp_path, HostSpec(governor_odd_cpus="powersave", nic_numa_swap=True))
    assert fp.settings["cpu.governor"] == "mixed:performance,powersave"
    g0 = fp.gpus[0]  # its rail NIC sits on the other socket: no NIC behind its switch any more
    assert (g0.nearest_nic, g0.nic_level) == ("0000:44:00.0", TopoLevel.NODE)
    assert {n.pci_bus_id: n.role for n in fp.nics}["0000:f1:00.0"] is DeviceRole.STORAGE  # near no GPU
    assert fp.topology_hash != _fp(tmp_path, name="good").topology_hash


@pytest.mark.parametrize("missing,key", [
    ("proc/sys/kernel/numa_balancing", "kernel.numa_balancing"),
    ("sys/kernel/mm/transparent_hugepage/enabled", "mm.thp_enabled"),
    ("sys/devices/system/cpu/isolated", "cpu.isolated"),
    ("sys/fs/cgroup/system.slice/cpuset.cpus.effective", "cgroup.system_cpus"),
    ("sys/module/nvidia/version", None),
])
def test_a_missing_file_is_not_applicable(tmp_path: Path, missing: str, key: str | None) -> None:
    fp = _fp(tmp_path, HostSpec(leave_out=(missing,)))
    if key is not None:
        assert key not in fp.settings
    else:
        assert "nvidia_driver" not in fp.versions


def test_empty_root_reads_an_empty_fingerprint(tmp_path: Path) -> None:
    fp = read_fingerprint(tmp_path, "local", "bare")
    assert fp.settings == {} and fp.versions == {} and fp.gpus == [] and fp.hardware.gpu_count == 0


def test_no_peermem_key_without_rdma(tmp_path: Path) -> None:
    root = build_host(tmp_path / "h", HostSpec(peermem=False))
    import shutil

    shutil.rmtree(root / "sys/class/infiniband")
    assert "gpudirect.peermem" not in read_fingerprint(root, "local", "h").settings


def test_vm_skips_acs(tmp_path: Path) -> None:
    fp = _fp(tmp_path, HostSpec(acs_on=("0000:19:00.0",), extra={"sys/hypervisor/type": "xen"}))
    assert "pcie.acs" not in fp.settings


def test_config_space_decoding() -> None:
    assert acs_source_validation(config_space(acs=True)) is True
    assert acs_source_validation(config_space(acs=False)) is False
    assert acs_source_validation(config_space(acs=None)) is None
    assert acs_source_validation(config_space(acs=True)[:64]) is None  # non-root read: 64 bytes only
    assert payload_sizes(config_space(acs=None, mps=512, mrrs=4096)) == (512, 4096)
    assert payload_sizes(b"") is None


def test_change_record_names_what_changed(tmp_path: Path) -> None:
    a = _fp(tmp_path, name="a")
    b = read_fingerprint(build_host(tmp_path / "b", HostSpec(governor="powersave")), "local", "a")
    assert fingerprint_change(a, a, "agent:x") is None
    ch = fingerprint_change(a, b, "agent:x")
    assert ch is not None and ch.changed == {"cpu.governor": ["performance", "powersave"]}
    assert not ch.topology_changed and ch.digest_before == a.digest != ch.digest_after
    first = fingerprint_change(None, a, "agent:x")
    assert first is not None and first.first
    assert Fingerprint.model_validate_json(a.to_json_bytes()) == a


def test_device_signature_changes_with_a_device(tmp_path: Path) -> None:
    root = build_host(tmp_path / "h")
    before = device_signature(root)
    (root / "sys/bus/pci/devices/0000:1b:00.0").unlink()
    assert device_signature(root) != before


def test_device_signature_ignores_virtual_netdevs_unless_asked(tmp_path: Path) -> None:
    """A pod's veth (its sys/class/net link under /devices/virtual/) is not a device change of the host: the
    30 s device poll would otherwise reread the fingerprint for every pod started on a container host."""
    root = build_host(tmp_path / "h")
    before, before_all = device_signature(root), device_signature(root, virtual=True)
    target = root / "sys/devices/virtual/net/veth1a2b"
    target.mkdir(parents=True)
    (root / "sys/class/net").mkdir(parents=True, exist_ok=True)
    (root / "sys/class/net/veth1a2b").symlink_to("../../devices/virtual/net/veth1a2b")
    assert device_signature(root) == before
    assert device_signature(root, virtual=True) != before_all
    phys = root / "sys/devices/pci0000:00/0000:00:01.0/0000:1c:00.0/net/ens9"
    phys.mkdir(parents=True)
    (root / "sys/class/net/ens9").symlink_to("../../devices/pci0000:00/0000:00:01.0/0000:1c:00.0/net/ens9")
    assert device_signature(root) != before


class FakeNvml:
    """A stand-in for `pynvml` with the calls the reader and the fixer make (values as NVML returns them)."""

    def __init__(self, gpus: int = 8) -> None:
        self.persistence = [0] + [1] * (gpus - 1)
        self.app = [(1410, 1593)] * gpus
        self.limit = [700_000] * gpus

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return len(self.persistence)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPersistenceMode(self, h: int) -> int:
        return self.persistence[h]

    def nvmlDeviceSetPersistenceMode(self, h: int, mode: int) -> None:
        self.persistence[h] = mode

    def nvmlDeviceGetEccMode(self, h: int) -> tuple[int, int]:
        return (1, 0) if h == 2 else (1, 1)

    def nvmlDeviceGetMigMode(self, h: int) -> tuple[int, int]:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return self.limit[h]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: int) -> int:
        return 700_000

    def nvmlDeviceGetApplicationsClock(self, h: int, clock: int) -> int:
        return self.app[h][0 if clock == 1 else 1]

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:
        return 1980 if clock == 1 else 1593

    def nvmlDeviceSetApplicationsClocks(self, h: int, mem: int, sm: int) -> None:
        self.app[h] = (sm, mem)

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040


async def test_nvml_settings_and_their_live_fixes(tmp_path: Path) -> None:
    from agents.commands import ReconfigureHandler
    from fleetmend.fingerprint import ReconfigureRequest

    root = build_host(tmp_path / "h")
    nv = FakeNvml()
    fp = read_fingerprint(root, "local", "h", nvml=nv)
    s = fp.settings
    assert s["gpu.persistence_mode"] == "mixed:disabled,enabled"
    assert s["gpu.ecc"] == "mixed:current=on pending=off,current=on pending=on"  # GPU 2 changes at next reboot
    assert "gpu.mig" not in s  # NOT_SUPPORTED: not applicable
    assert s["gpu.power_limit"] == "enforced=700W default=700W"
    assert s["gpu.app_clocks"] == "sm 1410/1980 MHz mem 1593/1593 MHz"
    assert fp.versions["cuda"] == "12.4"
    fixer = ReconfigureHandler(root, "local", "h", enabled=True, nvml=nv)
    report = await fixer.handle(ReconfigureRequest(cluster="local", node="h", dry_run=False,
                                                   fixes={"gpu.persistence_mode": "enabled",
                                                          "gpu.app_clocks": "at max"}))
    assert report.verified, report
    assert nv.persistence == [1] * 8 and nv.app == [(1980, 1593)] * 8
