"""`read_fingerprint(host_root)`: the node's hardware class, versions, topology and settings, read from files.

Every path is read under `host_root` (the agent's `agent.host_root`), so a recorded or synthesised tree stands in
for a host (tests/fixtures/hosts/). A file that does not exist means "not applicable here": its key is left out
of the fingerprint, never reported as a deviation. What is read, per check (docs/fleet-shape.md):

Key, what is read, note:
- `gpudirect.peermem`: `sys/module/nvidia_peermem/`, legacy `sys/kernel/mm/memory_peers/nv_mem/version`; only with
  NVIDIA GPUs and an RDMA device (`sys/class/infiniband/*`).
- `pcie.acs`: ACS Control of every bridge above a GPU or NIC (`<bridge>/config`): `off` or `on:<bdf>,…`; skipped in
  VMs (`sys/hypervisor/type`, cpuinfo flag `hypervisor`).
- `iommu.mode`: `sys/kernel/iommu_groups/*/type` (`identity` → `pt`, `DMA`/`DMA-FQ` → `translated`); `off` when
  `sys/class/iommu/` has no unit.
- `pcie.link.<role>.<bdf>`: `current_link_speed/width` and `max_link_*`; GPUs give only their max (they drop the
  link gen at idle, NVIDIA/open-gpu-kernel-modules#731).
- `pcie.payload.<role>.<bdf>`: Device Control in `config`, `MaxPayload 256 MaxReadReq 4096`.
- `cpu.governor`: `sys/devices/system/cpu/cpu*/cpufreq/scaling_governor`, one value or `mixed:a,b`.
- `cpu.max_cstate`: `sys/module/intel_idle/parameters/max_cstate`, `proc/cmdline` (`processor.max_cstate=`,
  `intel_idle.max_cstate=`, `idle=`).
- `mm.thp_enabled`, `mm.thp_defrag`: the bracketed word of `sys/kernel/mm/transparent_hugepage/{enabled,defrag}`.
- `kernel.numa_balancing`: `proc/sys/kernel/numa_balancing`.
- `irq.affinity.<role>.<bdf>`: each `<nic>/msi_irqs/<n>`'s `proc/irq/<n>/smp_affinity_list` within the NIC's
  `local_cpulist`: `local` or `off-node:<k>/<n>`.
- `cpu.isolated`, `cpu.nohz_full`: `sys/devices/system/cpu/{isolated,nohz_full}`, `none` when empty.
- `cgroup.system_cpus`: `sys/fs/cgroup/system.slice/cpuset.cpus.effective` (the CPUs system services may use).
- `ib.<role>.<dev>.<port>.{state,rate}`, `net.<role>.<if>.mtu`: `sys/class/infiniband/<dev>/ports/<p>/*`,
  `sys/class/net/<if>/mtu`.
- `roce.<role>.<dev>.traffic_class`, `roce.<role>.<if>.ecn`: `sys/class/infiniband/<dev>/tc/1/traffic_class`,
  `sys/class/net/<if>/ecn/roce_np/enable/<prio>` (Ethernet link layer only).
- `fabric.manager`: `running` or `stopped`, only where NVSwitches are on the PCI bus (vendor 0x10de, class
  0x068000) and `proc/<pid>/comm` can be read: the fabric manager's process is `nv-fabricmanager` (comm keeps 15
  characters: `nv-fabricmanage`).
- `irq.balance`: `running` or `stopped` (a process `irqbalance` in `proc/<pid>/comm`); left out where no process
  can be read (a recorded tree without `proc/<pid>`).
- `gpu.persistence_mode`, `gpu.ecc`, `gpu.mig`, `gpu.power_limit`, `gpu.app_clocks`: NVML (`nvml=`), current vs
  pending, enforced vs default limit, application clocks vs max.

Versions: `nvidia_driver` (`sys/module/nvidia/version`), `vbios` (`proc/driver/nvidia/gpus/<bdf>/information`),
`cuda` (NVML), `hca_fw` (`sys/class/infiniband/*/fw_ver`), `ofed` (`sys/module/mlx5_core/version`), `kernel`
(`proc/sys/kernel/osrelease`), `bios` (`sys/class/dmi/id/bios_version`). Hardware class: GPU model
(`information` "Model:" or the PCI id) and count, `sys/class/dmi/id/product_name`, `proc/cpuinfo` model name and
distinct physical ids, HCA `board_id` (PSID).

Not read here: the NCCL environment (a job's, not the node's: `fleetmend sweep --nccl-env`).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any

from agents.inventory.pci import (
    PciDevice,
    acs_source_validation,
    link,
    payload_sizes,
    read_config,
    read_text,
    scan,
    topo_level,
)
from fleetmend import __version__
from fleetmend.fingerprint import (
    DeviceRole,
    Fingerprint,
    GpuPlacement,
    HardwareClass,
    NicInfo,
    TopoLevel,
)

_BRACKET = re.compile(r"\[([^\]]+)\]")


def cpulist(text: str | None) -> set[int]:
    """`0-3,8,10-11` → {0,1,2,3,8,10,11}; empty set for None or empty text. Kernel cpulist format
    (Documentation/admin-guide/cputopology.rst)."""
    out: set[int] = set()
    for part in (text or "").replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            out.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            continue
    return out


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _gpu_info(root: Path, bdf: str) -> dict[str, str]:
    """`proc/driver/nvidia/gpus/<bdf>/information` as a dict ("Model", "Video BIOS", ...)."""
    text = read_text(root / "proc/driver/nvidia/gpus" / bdf / "information") or ""
    out: dict[str, str] = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def _cpuinfo(root: Path) -> tuple[str, int, bool]:
    """(model name, socket count, hypervisor flag) from `proc/cpuinfo`."""
    text = read_text(root / "proc/cpuinfo") or ""
    model, ids, hyper = "", set(), False
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k == "model name" and not model:
            model = " ".join(v.split())
        elif k == "physical id":
            ids.add(v.strip())
        elif k == "flags" and " hypervisor" in f" {v} ":
            hyper = True
    return model, len(ids) or (1 if model else 0), hyper


def _nic_role(nic: PciDevice, gpus: list[PciDevice], default_route_ifs: set[str], netdevs: list[str]) -> DeviceRole:
    if gpus and min(topo_level(nic, g).rank for g in gpus) <= TopoLevel.PXB.rank:
        return DeviceRole.COMPUTE
    if default_route_ifs & set(netdevs):
        return DeviceRole.MANAGEMENT
    return DeviceRole.STORAGE


def process_names(root: Path) -> set[str] | None:
    """The `comm` of every process under `root/proc` (kernel threads included), or None when there is no
    numeric `proc/<pid>` to read (not applicable: a recorded tree, a container without the host's PID namespace).
    A few hundred small reads: ~2 ms."""
    pids = [p for p in _listdir(root / "proc") if p.isdigit()]
    if not pids:
        return None
    return {c for p in pids if (c := read_text(root / "proc" / p / "comm"))}


FABRIC_MANAGER_COMM = "nv-fabricmanage"
"""`/proc/<pid>/comm` of `nv-fabricmanager` (TASK_COMM_LEN 16: 15 characters kept)."""


def _default_route_ifs(root: Path) -> set[str]:
    """Interfaces with a default route in `proc/net/route` (Destination 00000000)."""
    out: set[str] = set()
    for line in (read_text(root / "proc/net/route") or "").splitlines()[1:]:
        cols = line.split()
        if len(cols) > 1 and cols[1] == "00000000":
            out.add(cols[0])
    return out


def _nearest(dev: PciDevice, others: list[PciDevice]) -> tuple[str | None, TopoLevel | None]:
    if not others:
        return None, None
    best = min(others, key=lambda o: (topo_level(dev, o).rank, o.bdf))
    return best.bdf, topo_level(dev, best)


def _persistence(nvml: Any, h: Any) -> str:
    return "enabled" if nvml.nvmlDeviceGetPersistenceMode(h) else "disabled"


def _ecc(nvml: Any, h: Any) -> str:
    cur, pending = nvml.nvmlDeviceGetEccMode(h)
    return f"current={'on' if cur else 'off'} pending={'on' if pending else 'off'}"


def _mig(nvml: Any, h: Any) -> str:
    cur, pending = nvml.nvmlDeviceGetMigMode(h)
    return f"current={'on' if cur else 'off'} pending={'on' if pending else 'off'}"


def _power(nvml: Any, h: Any) -> str:
    return (f"enforced={nvml.nvmlDeviceGetEnforcedPowerLimit(h) // 1000}W "
            f"default={nvml.nvmlDeviceGetPowerManagementDefaultLimit(h) // 1000}W")


def _app_clocks(nvml: Any, h: Any) -> str:
    """`at max` or `sm 1410/1980 MHz mem 1593/1593 MHz` (application clocks against the max, NVML_CLOCK_SM=1,
    NVML_CLOCK_MEM=2; Azure azure_gpu_app_clocks.nhc resets them to max)."""
    app = [nvml.nvmlDeviceGetApplicationsClock(h, c) for c in (1, 2)]
    top = [nvml.nvmlDeviceGetMaxClockInfo(h, c) for c in (1, 2)]
    return "at max" if app == top else f"sm {app[0]}/{top[0]} MHz mem {app[1]}/{top[1]} MHz"


def _nvml_settings(nvml: Any, settings: dict[str, str], versions: dict[str, str]) -> None:
    """Persistence, ECC and MIG (current vs pending), enforced vs default power limit, CUDA driver version."""
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: the GPU settings are not applicable here
        return
    try:
        n = nvml.nvmlDeviceGetCount()
        pm: set[str] = set()
        ecc: set[str] = set()
        mig: set[str] = set()
        power: set[str] = set()
        clocks: set[str] = set()
        for i in range(n):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            for target, call in ((pm, _persistence), (ecc, _ecc), (mig, _mig), (power, _power),
                                 (clocks, _app_clocks)):
                try:
                    target.add(call(nvml, h))
                except Exception:  # noqa: BLE001 - NVML_ERROR_NOT_SUPPORTED on this GPU: not applicable
                    continue
        for key, values in (("gpu.persistence_mode", pm), ("gpu.ecc", ecc), ("gpu.mig", mig), ("gpu.power_limit", power),
                            ("gpu.app_clocks", clocks)):
            if values:
                settings[key] = values.pop() if len(values) == 1 else "mixed:" + ",".join(sorted(values))
        try:
            cuda = nvml.nvmlSystemGetCudaDriverVersion()
            versions["cuda"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except Exception:  # noqa: BLE001 - not applicable
            pass
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a library that is going away
            pass


def read_fingerprint(host_root: Path | str, cluster: str, node: str, *, nvml: Any = None,
                     agent_version: str = __version__) -> Fingerprint:
    """Read the node's `Fingerprint` under `host_root` (see the module docstring for what and where).

    Args:
        host_root: the host's `/` (a fixture tree in tests).
        nvml: the `pynvml` module or a stand-in for the GPU settings; None leaves them out (not applicable).
    Returns:
        `Fingerprint` with `read_ms` set to the wall time of the read (< 200 ms on an 8-GPU host, bench/inventory_cost.py).
    Raises:
        Nothing for a missing or unreadable file (its key is left out).
    """
    t0 = time.perf_counter()
    root = Path(host_root)
    devices = scan(root)
    gpus = sorted((d for d in devices.values() if d.is_gpu), key=lambda d: d.bdf)
    nics = sorted((d for d in devices.values() if d.is_nic), key=lambda d: d.bdf)
    nvmes = sorted((d for d in devices.values() if d.is_nvme), key=lambda d: d.bdf)
    settings: dict[str, str] = {}
    roles: dict[str, DeviceRole] = {}
    versions: dict[str, str] = {}

    def put(key: str, value: str | None, role: DeviceRole = DeviceRole.NODE) -> None:
        if value is not None:
            settings[key] = value
            if role is not DeviceRole.NODE:
                roles[key] = role

    # --- NICs: RDMA device, netdevs, role
    default_ifs = _default_route_ifs(root)
    nic_infos: list[NicInfo] = []
    nic_role: dict[str, DeviceRole] = {}
    for nic in nics:
        ib = _listdir(nic.path / "infiniband")
        netdevs = _listdir(nic.path / "net")
        role = _nic_role(nic, gpus, default_ifs, netdevs)
        nic_role[nic.bdf] = role
        layer = read_text(root / "sys/class/infiniband" / ib[0] / "ports/1/link_layer") if ib else None
        nic_infos.append(NicInfo(pci_bus_id=nic.bdf, role=role, numa_node=nic.numa_node,
                                 ib_device=ib[0] if ib else None, netdevs=netdevs, link_layer=layer))
    compute_nics = [n for n in nics if nic_role[n.bdf] is DeviceRole.COMPUTE] or nics

    # --- topology
    placements: list[GpuPlacement] = []
    for g in gpus:
        nic_bdf, nic_level = _nearest(g, compute_nics)
        nvme_bdf, nvme_level = _nearest(g, nvmes)
        placements.append(GpuPlacement(pci_bus_id=g.bdf, numa_node=g.numa_node,
                                       local_cpulist=read_text(g.path / "local_cpulist"), nearest_nic=nic_bdf,
                                       nic_level=nic_level, nearest_nvme=nvme_bdf, nvme_level=nvme_level))
    topo = hashlib.sha256("\n".join(
        f"{p.pci_bus_id},{p.numa_node},{p.nearest_nic},{p.nic_level},{p.nearest_nvme},{p.nvme_level}"
        for p in placements).encode()).hexdigest()[:16] if placements else ""

    # --- hardware class
    infos = {g.bdf: _gpu_info(root, g.bdf) for g in gpus}
    models = sorted({infos[g.bdf].get("Model") or f"10de:{g.device:04x}" for g in gpus})
    cpu_model, sockets, hypervisor = _cpuinfo(root)
    ib_devs = _listdir(root / "sys/class/infiniband")
    psids = sorted({p for d in ib_devs if (p := read_text(root / "sys/class/infiniband" / d / "board_id"))})
    hardware = HardwareClass(gpu_model="/".join(models), gpu_count=len(gpus),
                             board=read_text(root / "sys/class/dmi/id/product_name") or "",
                             cpu_model=cpu_model, cpu_sockets=sockets, hca_models=psids)

    # --- versions
    for key, rel in (("nvidia_driver", "sys/module/nvidia/version"), ("ofed", "sys/module/mlx5_core/version"),
                     ("kernel", "proc/sys/kernel/osrelease"), ("bios", "sys/class/dmi/id/bios_version")):
        if (v := read_text(root / rel)):
            versions[key] = v
    vbios = sorted({v for i in infos.values() if (v := i.get("Video BIOS"))})
    if vbios:
        versions["vbios"] = ",".join(vbios)
    fws = sorted({v for d in ib_devs if (v := read_text(root / "sys/class/infiniband" / d / "fw_ver"))})
    if fws:
        versions["hca_fw"] = ",".join(fws)

    # --- GPUDirect RDMA
    if gpus and ib_devs:
        if (root / "sys/module/nvidia_peermem").is_dir():
            put("gpudirect.peermem", "loaded")
        elif (root / "sys/kernel/mm/memory_peers/nv_mem/version").exists():
            put("gpudirect.peermem", "loaded:nv_peer_mem")
        else:
            put("gpudirect.peermem", "absent")

    # --- ACS on the bridges above GPUs and NICs (bare metal only)
    virtual = hypervisor or read_text(root / "sys/hypervisor/type") is not None
    if not virtual and (gpus or nics):
        bridges = sorted({b for d in (*gpus, *nics) for b in d.chain if b in devices})
        states = {b: acs_source_validation(read_config(devices[b].path)) for b in bridges}
        known = {b: s for b, s in states.items() if s is not None}
        if known:
            on = [b for b, s in known.items() if s]
            put("pcie.acs", "on:" + ",".join(on) if on else "off")

    # --- IOMMU
    groups = _listdir(root / "sys/kernel/iommu_groups")
    if groups:
        types = {read_text(root / "sys/kernel/iommu_groups" / g / "type") for g in groups} - {None}
        put("iommu.mode", "pt" if types == {"identity"} else ("translated" if types else "on"))
    elif (root / "sys/class/iommu").is_dir() or (root / "sys/kernel/iommu_groups").is_dir():
        put("iommu.mode", "off" if not _listdir(root / "sys/class/iommu") else "on")

    # --- PCIe link and payload per device
    for dev, role in ([(g, DeviceRole.GPU) for g in gpus] + [(n, nic_role[n.bdf]) for n in nics]
                      + [(m, DeviceRole.NVME) for m in nvmes]):
        lk = link(dev.path)
        if lk is not None and role is DeviceRole.GPU:
            lk = lk[lk.index("(max ") + 5:-1] if "(max " in lk else lk
            lk = f"max {lk}"
        put(f"pcie.link.{role.value}.{dev.bdf}", lk, role)
        sizes = payload_sizes(read_config(dev.path))
        if sizes:
            put(f"pcie.payload.{role.value}.{dev.bdf}", f"MaxPayload {sizes[0]} MaxReadReq {sizes[1]}", role)

    # --- CPU
    cpu_base = root / "sys/devices/system/cpu"
    govs = {v for c in _listdir(cpu_base) if c.startswith("cpu") and c[3:].isdigit()
            if (v := read_text(cpu_base / c / "cpufreq/scaling_governor"))}
    if govs:
        put("cpu.governor", govs.pop() if len(govs) == 1 else "mixed:" + ",".join(sorted(govs)))
    cmdline = (read_text(root / "proc/cmdline") or "").split()
    limits = [a for a in cmdline if a.startswith(("processor.max_cstate=", "intel_idle.max_cstate=", "idle="))]
    intel = read_text(root / "sys/module/intel_idle/parameters/max_cstate")
    if intel is not None:
        limits.append(f"intel_idle={intel}")
    if limits:
        put("cpu.max_cstate", " ".join(sorted(limits)))
    for name in ("isolated", "nohz_full"):
        v = read_text(cpu_base / name)
        put(f"cpu.{name}", None if v is None else ("none" if v in ("", "(null)") else v))
    put("cgroup.system_cpus", read_text(root / "sys/fs/cgroup/system.slice/cpuset.cpus.effective"))

    # --- memory and scheduler
    for key, rel in (("mm.thp_enabled", "sys/kernel/mm/transparent_hugepage/enabled"),
                     ("mm.thp_defrag", "sys/kernel/mm/transparent_hugepage/defrag")):
        text = read_text(root / rel)
        if text is not None:
            m = _BRACKET.search(text)
            put(key, m.group(1) if m else text)
    put("kernel.numa_balancing", read_text(root / "proc/sys/kernel/numa_balancing"))

    # --- NIC IRQ affinity, IB ports, RoCE
    for nic, info in zip(nics, nic_infos, strict=True):
        role = info.role
        local = cpulist(read_text(nic.path / "local_cpulist"))
        irqs = _listdir(nic.path / "msi_irqs")
        if local and irqs:
            off = sum(1 for n in irqs
                      if (aff := cpulist(read_text(root / "proc/irq" / n / "smp_affinity_list"))) and not aff <= local)
            put(f"irq.affinity.{role.value}.{nic.bdf}", "local" if off == 0 else f"off-node:{off}/{len(irqs)}", role)
        if info.ib_device:
            ports = root / "sys/class/infiniband" / info.ib_device / "ports"
            for p in _listdir(ports):
                base = f"ib.{role.value}.{info.ib_device}.{p}"
                put(f"{base}.state", read_text(ports / p / "state"), role)
                put(f"{base}.rate", read_text(ports / p / "rate"), role)
            if info.link_layer == "Ethernet":
                put(f"roce.{role.value}.{info.ib_device}.traffic_class",
                    read_text(root / "sys/class/infiniband" / info.ib_device / "tc/1/traffic_class"), role)
        for ifname in info.netdevs:
            put(f"net.{role.value}.{ifname}.mtu", read_text(root / "sys/class/net" / ifname / "mtu"), role)
            ecn = root / "sys/class/net" / ifname / "ecn/roce_np/enable"
            prios = _listdir(ecn)
            if prios:
                on = [p for p in prios if read_text(ecn / p) == "1"]
                put(f"roce.{role.value}.{ifname}.ecn", "on:" + ",".join(on) if on else "off", role)

    # --- services: the fabric manager on NVSwitch boards, irqbalance (it rewrites the IRQ affinity above)
    procs = process_names(root)
    if procs is not None:
        if any(d.is_nvswitch for d in devices.values()):
            put("fabric.manager", "running" if any(c.startswith(FABRIC_MANAGER_COMM) for c in procs) else "stopped")
        put("irq.balance", "running" if "irqbalance" in procs else "stopped")

    if nvml is not None and gpus:
        _nvml_settings(nvml, settings, versions)

    # --- part identities (the incident ledger: was the faulty part replaced?): GPU UUID, NVMe serial, HCA GUID
    serials = {g.bdf: u for g in gpus if (u := infos[g.bdf].get("GPU UUID"))}
    for nvme in nvmes:
        for ctrl in _listdir(nvme.path / "nvme"):
            if (sn := read_text(nvme.path / "nvme" / ctrl / "serial")):
                serials[nvme.bdf] = serials[ctrl] = sn
    for hca in nics:
        for rdma in _listdir(hca.path / "infiniband"):
            if (guid := read_text(hca.path / "infiniband" / rdma / "node_guid")):
                serials[hca.bdf] = serials[rdma] = guid
    return Fingerprint(cluster=cluster, node=node, agent_version=agent_version, hardware=hardware,
                       versions=versions, gpus=placements, nics=nic_infos, topology_hash=topo, settings=settings,
                       roles=roles, read_ms=round((time.perf_counter() - t0) * 1000, 3), serials=serials)


def device_signature(host_root: Path | str, virtual: bool = False) -> tuple[tuple[str, ...], ...]:
    """The sets of PCI functions, RDMA devices and netdevs: what a udev add/remove changes. Three directory
    listings (and one readlink per netdev), cheap enough to poll every few seconds.

    `virtual`: also count netdevs whose `sys/class/net/<name>` link points under `/devices/virtual/` (veth,
    bridges, tunnels). Off by default, like the uevent path: a container host makes a veth per pod, and each
    would otherwise start a fingerprint read; a physical NIC's link points at its PCI device."""
    root = Path(host_root)
    net = _listdir(root / "sys/class/net")
    if not virtual:
        net = [n for n in net if not _is_virtual_netdev(root / "sys/class/net" / n)]
    return (tuple(_listdir(root / "sys/bus/pci/devices")), tuple(_listdir(root / "sys/class/infiniband")), tuple(net))


def _is_virtual_netdev(link: Path) -> bool:
    """`sys/class/net/<name>` is a symlink to `../../devices/virtual/net/<name>` for a software device."""
    try:
        return "/devices/virtual/" in os.readlink(link)
    except OSError:  # not a link (a recorded fixture root's plain directory): a device
        return False
