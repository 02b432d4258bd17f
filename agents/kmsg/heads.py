"""The kernel-log heads, in order: which messages start a fault record, and the kinds each can start.

`match_head` runs on every kernel message the agent reads, so each head has a substring guard: its
builder (in `agents.kmsg.matchers`, which holds the patterns and their kernel/driver sources) runs
only on messages holding one of `guard`'s substrings (or passing `also`, a cheap test for what a
substring cannot say). Heads are tried in `HEADS` order and the first candidate wins: an `NVRM: Xid`
line is an XID before it is anything else, an mlx5 message is read for firmware faults before its
IB port state, a panic before the lockup it names. The kinds a head lists are every kind its builder
returns; `tests/test_catalog.py` checks each has a catalog row, and `tests/test_kmsg_corpus.py` that
the builders keep to their lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ahocorasick_rs

from agents.kmsg import matchers as m
from agents.kmsg.matchers import Candidate


@dataclass(frozen=True, slots=True)
class Head:
    """One row of `HEADS`.

    name: the message family; kinds: every kind `build` returns; guard: `build` runs on text holding
    one of these substrings; also: or on text this cheap test accepts; build: text (framing removed,
    stripped) -> the candidate it starts, or None.
    """

    name: str
    kinds: tuple[str, ...]
    guard: tuple[str, ...]
    build: Callable[[str], Candidate | None]
    also: Callable[[str], bool] | None = None

    def tries(self, text: str) -> bool:
        """Whether the guard lets `build` run on `text` (stripped)."""
        return any(g in text for g in self.guard) or (self.also is not None and self.also(text))


_NVRM_GPU = ("NVRM", "GPU")

# Head(name, kinds, guard, build[, also]), in the order they are tried.
HEADS: tuple[Head, ...] = (
    Head("xid", ("xid",), ("Xid",), m.xid_head),
    Head("gpu_lost", ("gpu_fallen_off_bus",), _NVRM_GPU, m.gpu_lost_head),
    Head("gpu_is_lost", ("gpu_fallen_off_bus",), ("GPU_IS_LOST", "GPU is lost"), m.gpu_is_lost_head),
    Head("amdgpu", ("gpu_ring_timeout", "gpu_reset_failed", "gpu_ras_uncorrectable"),
         ("timeout, signaled seq", "uncorrectable hardware error", "GPU reset(", "GPU Recovery Failed",
          "GPU reset end", "ASIC reset failed"), m.amdgpu_head),
    Head("gpu_reset_required", ("gpu_reset_required",), ("NVRM",), m.gpu_reset_required_head),
    Head("gsp", ("gsp_error",), _NVRM_GPU, m.gsp_head),
    Head("gpu_boot", ("gpu_init_failed", "gpu_fsp_error"), ("NVRM",), m.gpu_boot_head),
    Head("nvlink_discovery", ("nvlink_discovery_failed",), _NVRM_GPU, m.nvlink_discovery_head),
    Head("sxid", ("sxid_fatal", "sxid_nonfatal"), ("SXid",), m.sxid_head),
    Head("peermem", ("peermem_invalid_context",), ("peermem",), m.peermem_head),
    Head("aer", ("aer_corrected", "aer_nonfatal", "aer_fatal", "aer_recovery_failed"),
         ("rror", "ecovery", "containment event"), m.aer_head),
    Head("pciehp", ("pcie_slot_link_down", "pcie_slot_link_up"), ("pciehp",), m.pciehp_head),
    Head("pcie_bandwidth", ("pcie_link_degraded", "pcie_bandwidth_limited"), ("PCIe bandwidth",),
         m.pcie_bandwidth_head),
    Head("edac", ("edac_ce", "edac_ue"), ("EDAC",), m.edac_head),
    Head("hardware_error",
         ("ghes_recoverable", "ghes_corrected", "ghes_fatal", "mce", "mce_corrected_repeated", "mce_recoverable",
          "mce_uncorrected"),
         ("Hardware Error", "mce:", "achine check", "Memory error"), m.hardware_error_head),
    Head("mlx5_fw",
         ("mlx5_fw_fatal", "mlx5_health_warning", "mlx5_cmd_timeout", "mlx5_cmd_recovered", "nic_link_up",
          "nic_link_down", "nic_temperature_high"),
         ("mlx5",), m.mlx5_fw_head),
    Head("fabric_device", ("ib_module_error", "ib_module_unplugged", "ib_module_plugged", "efa_admin_timeout"),
         ("Port module event", "efa "), m.fabric_device_head),
    Head("ib", ("ib_port_down", "ib_port_init", "ib_port_active", "ib_insufficient_power", "ib_access_reg_noise"),
         ("mlx5", "Port: "), m.ib_head),
    Head("nic_tx", ("nic_tx_timeout", "nic_reset_failed"), ("NETDEV WATCHDOG", "dev_watchdog", "transmit timeout"),
         m.nic_tx_head,
         also=m.pci_prefixed),
    Head("nic_link", ("nic_link_up", "nic_link_down"), ("Link is", "mlx4_en"), m.nic_link_head),
    Head("bond", ("bond_slave_up", "bond_slave_down", "bond_no_active_slave", "bond_active_slave"),
         ("bond", "active interface", "slave", "link status"), m.bond_head),
    Head("nvme", ("nvme_timeout", "nvme_removed"), ("nvme",), m.nvme_head),
    Head("pci_power", ("gpu_fallen_off_bus", "nic_removed"), ("device inaccessible", "config space inaccessible", "; giving up"),
         m.pci_power_head),
    Head("storage", ("block_io_error", "fs_read_only", "fs_error", "md_member_failed", "md_array_failed",
                     "md_array_degraded", "nvme_no_path", "nvme_path_requeue"),
         (" error, dev ", "Buffer I/O error", "-fs", "Aborting journal", "JBD2: ", "XFS (", "md/raid", " path - ",
          "@ LBA"),
         m.storage_head),
    Head("nfs", ("nfs_server_not_responding", "nfs_server_ok"), (": server ",), m.nfs_head),
    Head("os_limit", ("os_file_max_reached", "conntrack_table_full", "cmci_storm", "cmci_storm_subsided",
                      "gpu_library_segfault"), ("file-max", "table full", "CMCI storm", " in lib"), m.os_limit_head),
    Head("cpu_thermal", ("cpu_thermal_throttle", "cpu_thermal_normal"), ("temperature above threshold",
                                                                        "temperature/speed normal"), m.cpu_thermal_head),
    Head("memory_failure", ("memory_failure",), ("due to hardware memory corruption", "recovery action for",
                                                 "page recovery: "), m.memory_failure_head),
    Head("panic", ("kernel_panic", "ghes_fatal", "mce_uncorrected"), ("Kernel panic - not syncing",), m.panic_head),
    Head("lockup", ("soft_lockup", "hard_lockup"), (), m.lockup_head, also=m.has_lockup),
    Head("oops", ("oops",), ("BUG", "general protection fault", "divide error: ", "Oops", "invalid opcode"),
         m.oops_head),
    Head("hung_task", ("hung_task",), ("blocked for more than",), m.hung_task_head),
    Head("rcu_stall", ("rcu_stall",), ("stall on CPU", "stalls on "), m.rcu_stall_head),
    Head("netdev_unregister", ("netdev_unregister_stuck",), ("unregister_netdevice",), m.netdev_unregister_head),
    Head("oom", ("oom_kill",), ("oom", "Kill", "memory"), m.oom_head),
)
"""Every head, in the order `match_head` tries them."""

_WORDS = tuple(dict.fromkeys(g for h in HEADS for g in h.guard))
_FINDER = ahocorasick_rs.AhoCorasick(list(_WORDS))
"""Every guard substring, found in one Aho-Corasick pass per message (C speed; a Python loop over the
heads' guards costs more than the heads themselves on the lines that start nothing)."""
_WORD_HEADS = tuple(sum(1 << n for n, h in enumerate(HEADS) if w in h.guard) for w in _WORDS)
"""For each guard word (as `_FINDER` numbers them), the heads it lets run (bit n: `HEADS[n]`)."""
_PLANS: dict[int, tuple[tuple[Callable[[str], bool] | None, Callable[[str], Candidate | None]], ...]] = {}
"""Heads whose guard words were found (bit n: `HEADS[n]`) -> the (test, build) pairs to try, in `HEADS` order: test None
for a head a found word lets run, the head's `also` for a head with one whose words were not found; heads neither
lets run are left out. Built once per set of heads met (a few dozen in a real log; at most `_PLANS_MAX` kept)."""
_PLANS_MAX = 4096


def _plan(heads: int) -> tuple[tuple[Callable[[str], bool] | None, Callable[[str], Candidate | None]], ...]:
    plan = tuple((None if heads >> n & 1 else h.also, h.build) for n, h in enumerate(HEADS)
                 if heads >> n & 1 or h.also is not None)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[heads] = plan
    return plan


def match_head(text: str) -> Candidate | None:
    """The fault candidate a kernel message starts, or None.

    Args:
        text: the message with framing removed (leading indentation allowed).
    Returns:
        `Candidate` (kind, code, bdf, pid, attrs, family) of the first head in `HEADS` whose guard
        lets it run (`Head.tries`) and whose builder reads the message; None for messages that start
        no fault.
    """
    t = text.strip()
    if not t:
        return None
    heads = 0
    for i, _, _ in _FINDER.find_matches_as_indexes(t, overlapping=True):
        heads |= _WORD_HEADS[i]
    for test, build in _PLANS.get(heads) or _plan(heads):  # no word found (most messages): the heads with `also`
        if test is None or test(t):
            c = build(t)
            if c is not None:
                return c
    return None
