"""The three judging layers of `fleetmend.drift`: pure functions, property-tested with hypothesis."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetmend.drift import (
    DEFAULT_INVARIANTS,
    AllowedSet,
    CohortStatus,
    FixKind,
    Layer,
    check_of,
    cohort_verdict,
    judge,
    load_invariants,
)
from fleetmend.errors import ConfigError
from fleetmend.fingerprint import DeviceRole, Fingerprint, HardwareClass

H100 = HardwareClass(gpu_model="NVIDIA H100 80GB HBM3", gpu_count=8, board="DGXH100", cpu_model="Xeon", cpu_sockets=2)
A100 = HardwareClass(gpu_model="NVIDIA A100-SXM4-80GB", gpu_count=8, board="DGXA100", cpu_model="EPYC", cpu_sockets=2)
GOOD = {"cpu.governor": "performance", "gpudirect.peermem": "loaded", "kernel.numa_balancing": "0",
        "mm.thp_enabled": "never"}


def fp(node: str, hw: HardwareClass = H100, roles: dict[str, DeviceRole] | None = None, **settings_: str) -> Fingerprint:
    s = dict(GOOD)
    s.update({k.replace("__", "."): v for k, v in settings_.items()})
    return Fingerprint(cluster="c", node=node, hardware=hw, settings=s, roles=roles or {},
                       versions={"nvidia_driver": "550.90.07"})


values_st = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=6), st.sampled_from(["x", "y", "z"]),
                            min_size=0, max_size=30)


@given(values_st, st.integers(2, 10), st.floats(0.5, 0.95))
@settings(max_examples=300, deadline=None)
def test_cohort_verdict_properties(values: dict[str, str], quorum: int, majority: float) -> None:
    v = cohort_verdict(values, quorum, majority)
    assert v.size == len(values)
    counts = Counter(values.values()).most_common()
    if v.status is CohortStatus.DRIFT:
        # a clear majority of a big enough cohort; exactly the others deviate, never the majority
        assert v.size >= quorum and v.share >= majority and v.mode == counts[0][0]
        assert len(counts) < 2 or counts[1][1] < counts[0][1]
        assert set(v.deviants) == {n for n, x in values.items() if x != v.mode} != set()
    else:
        assert v.deviants == ()
    if v.status is CohortStatus.UNIFORM:
        assert len(counts) == 1
    if v.status is CohortStatus.SPLIT:
        assert v.size >= quorum and (v.share < majority or counts[0][1] == counts[1][1])
    if v.status is CohortStatus.TOO_SMALL:
        assert v.size < quorum or v.size == 0


@given(st.integers(1, 20), st.integers(0, 20))
def test_a_tie_is_never_drift(n: int, extra: int) -> None:
    values = {f"a{i}": "x" for i in range(n)} | {f"b{i}": "y" for i in range(n)}
    assert cohort_verdict(values, quorum=2).status in (CohortStatus.SPLIT, CohortStatus.TOO_SMALL)
    del extra


@given(st.lists(st.sampled_from(["0", "1"]), min_size=0, max_size=12), st.permutations(list(range(12))))
@settings(max_examples=100, deadline=None)
def test_judge_does_not_depend_on_order(values: list[str], perm: list[int]) -> None:
    fps = [fp(f"n{i}", kernel__numa_balancing=v) for i, v in enumerate(values)]
    order = [fps[i] for i in perm if i < len(fps)]
    a, b = judge(fps), judge(order)
    assert a.deviations == b.deviations and a.cohorts == b.cohorts


@given(st.integers(5, 12), st.sampled_from(list(GOOD)))
@settings(max_examples=40, deadline=None)
def test_one_odd_node_in_a_quorum_is_named_alone(n: int, key: str) -> None:
    fps = [fp(f"n{i}") for i in range(n)]
    odd = dict(GOOD)
    odd[key] = "odd"
    fps[0] = Fingerprint(cluster="c", node="n0", hardware=H100, settings=odd)
    devs = judge(fps).deviations
    assert [(d.node, d.key) for d in devs] == [("n0", key)]
    assert devs[0].layer is (Layer.POLICY if key in ("cpu.governor", "gpudirect.peermem") else Layer.COHORT)


def test_the_issue_case_five_against_one() -> None:
    fps = [fp(f"n{i}") for i in range(5)] + [fp("bad", cpu__governor="powersave", gpudirect__peermem="absent",
                                                kernel__numa_balancing="1")]
    r = judge(fps)
    assert {(d.node, d.key) for d in r.deviations} == {("bad", "cpu.governor"), ("bad", "gpudirect.peermem"),
                                                       ("bad", "kernel.numa_balancing")}
    assert {d.kind for d in r.deviations} == {"config_drift_governor", "config_drift_peermem",
                                              "config_drift_numa_balancing"}
    assert all(d.fix is FixKind.LIVE for d in r.deviations)
    nb = next(d for d in r.deviations if d.key == "kernel.numa_balancing")
    assert nb.expected == ("0",) and nb.wanted == "0" and "83%" in nb.reason
    assert r.splits == []


def test_three_against_three_is_a_split_and_no_deviation() -> None:
    fps = [fp(f"n{i}", kernel__numa_balancing="1" if i < 3 else "0") for i in range(6)]
    r = judge(fps)
    assert r.deviations == []
    (split,) = r.splits
    assert (split.key, split.verdict.size, split.verdict.share, split.verdict.mode) == ("kernel.numa_balancing", 6,
                                                                                        0.5, None)


def test_small_cohorts_are_not_judged_by_majority_but_policy_still_holds() -> None:
    fps = [fp("a"), fp("b"), fp("c", kernel__numa_balancing="1", cpu__governor="powersave")]
    r = judge(fps)
    assert [(d.node, d.key, d.layer) for d in r.deviations] == [("c", "cpu.governor", Layer.POLICY)]


def test_cohorts_are_keyed_by_class_and_role() -> None:
    # 5 H100 nodes agree, 5 A100 nodes agree on another driver: nobody deviates
    fps = [fp(f"h{i}") for i in range(5)] + [
        Fingerprint(cluster="c", node=f"a{i}", hardware=A100, settings=GOOD, versions={"nvidia_driver": "535.1"})
        for i in range(5)]
    assert judge(fps).deviations == []
    # a storage NIC at 200G is never compared with compute NICs at 400G
    roles = {"ib.compute.mlx5_0.1.rate": DeviceRole.COMPUTE}
    fps = [fp(f"n{i}", roles=roles, ib__compute__mlx5_0__1__rate="400") for i in range(5)]
    fps.append(fp("s", roles={"ib.storage.mlx5_0.1.rate": DeviceRole.STORAGE}, ib__storage__mlx5_0__1__rate="200"))
    r = judge(fps)
    assert r.deviations == []
    assert {(c.role, c.verdict.status) for c in r.cohorts if c.key.startswith("ib.")} == {
        (DeviceRole.COMPUTE, CohortStatus.UNIFORM), (DeviceRole.STORAGE, CohortStatus.UNIFORM)}


def test_a_missing_key_is_never_a_deviation() -> None:
    fps = [fp(f"n{i}") for i in range(6)]
    s = dict(GOOD)
    del s["gpudirect.peermem"], s["kernel.numa_balancing"]
    fps.append(Fingerprint(cluster="c", node="vm", hardware=H100, settings=s, versions={"nvidia_driver": "550.90.07"}))
    assert judge(fps).deviations == []


def test_allowed_set_suspends_majority_and_policy_for_its_key() -> None:
    fps = [Fingerprint(cluster="c", node=f"n{i}", hardware=H100, settings=GOOD,
                       versions={"nvidia_driver": "550.90.07" if i < 5 else "560.35.03"}) for i in range(6)]
    assert [(d.node, d.key) for d in judge(fps).deviations] == [("n5", "version.nvidia_driver")]
    allow = {"version.nvidia_driver": AllowedSet("version.nvidia_driver", frozenset({"550.90.07", "560.35.03"}),
                                                 "ops@site", "driver rollout R42")}
    assert judge(fps, allowed=allow).deviations == []
    allow_only_new = {"version.nvidia_driver": AllowedSet("version.nvidia_driver", frozenset({"560.35.03"}),
                                                          "ops@site", "rollout done")}
    devs = judge(fps, allowed=allow_only_new).deviations
    assert {d.node for d in devs} == {f"n{i}" for i in range(5)} and all(d.layer is Layer.ALLOWED for d in devs)
    governor = {"cpu.governor": AllowedSet("cpu.governor", frozenset({"performance", "schedutil"}), "ops", "trial")}
    odd = [fp(f"n{i}") for i in range(5)] + [fp("t", cpu__governor="schedutil")]
    assert judge(odd, allowed=governor).deviations == []


def test_operator_file_replaces_one_invariant(tmp_path: Path) -> None:
    f = tmp_path / "drift.toml"
    f.write_text('[invariant."cpu.governor"]\nexpected = ["performance", "schedutil"]\nreason = "site policy"\n'
                 '[invariant."gpudirect.peermem"]\nexpected = []\n')
    inv = load_invariants(f)
    assert len(inv) == len(DEFAULT_INVARIANTS)
    fps = [fp(f"n{i}") for i in range(5)] + [fp("t", cpu__governor="schedutil", gpudirect__peermem="absent")]
    # peermem's row is off: it becomes a cohort fact, and 5 of 6 'loaded' makes 'absent' a cohort deviation
    assert [(d.key, d.layer) for d in judge(fps, inv).deviations] == [("gpudirect.peermem", Layer.COHORT)]
    f.write_text('[invariant."cpu.governor"]\nexpcted = ["x"]\n')
    with pytest.raises(ConfigError, match="needs expected"):
        load_invariants(f)
    f.write_text("not toml [")
    with pytest.raises(ConfigError):
        load_invariants(f)


def test_checks_cover_the_issue_keys() -> None:
    assert check_of("irq.affinity.compute.0000:1c:00.0").kind == "config_drift_irq_affinity"
    assert check_of("version.hca_fw").fix is FixKind.REPAIR
    assert check_of("iommu.mode").fix is FixKind.REBOOT and check_of("pcie.acs").fix is FixKind.REBOOT
    assert check_of("something.new").name == "version"


def test_nccl_ib_hca_against_the_gpu_local_hcas() -> None:
    from fleetmend.drift import nccl_ib_hca
    from fleetmend.fingerprint import NicInfo

    nics = [NicInfo(pci_bus_id=f"0000:{i:02x}:00.0", role=DeviceRole.COMPUTE, ib_device=f"mlx5_{i}") for i in range(4)]
    nics.append(NicInfo(pci_bus_id="0000:f0:00.0", role=DeviceRole.STORAGE, ib_device="mlx5_4"))
    node = Fingerprint(cluster="c", node="n", hardware=H100, nics=nics)
    assert nccl_ib_hca(None, node).extra == ("mlx5_4",)  # unset: the storage HCA carries collectives too
    assert nccl_ib_hca("=mlx5_0,mlx5_1,mlx5_2,mlx5_3", node).ok
    assert nccl_ib_hca("^=mlx5_4", node).ok
    chk = nccl_ib_hca("mlx5_0:1,mlx5_1:1", node)
    assert chk.missing == ("mlx5_2", "mlx5_3") and chk.extra == ()
    assert nccl_ib_hca("mlx5", node).extra == ("mlx5_4",)  # a prefix selects every mlx5_*


def test_placement_changes_after_a_repair() -> None:
    """Only what got worse or moved counts: a GPU gone, a NIC/NVMe farther, or as near through another device; a
    device back (the drain's fault had taken it) or a GPU new is no change."""
    from fleetmend.drift import placement_changes

    before = {"g0": ["n0", "PIX", "d0", "PIX", 0], "g1": ["n1", "PIX", None, None, 0], "g2": ["n9", "SYS", None, None, 1]}
    assert placement_changes(before, dict(before)) == []
    after = {"g0": ["n0", "PIX", "d0", "PIX", 0], "g1": ["n1", "PIX", "d1", "PXB", 0], "g2": ["n2", "PIX", None, None, 1],
             "g3": ["n3", "PIX", None, None, 1]}
    assert placement_changes(before, after) == []  # g1 gained an NVMe, g2 its own NIC back, g3 is new
    moved = {"g0": ["n5", "PIX", "d0", "PIX", 0], "g1": ["n1", "NODE", None, None, 0]}
    assert placement_changes(before, moved) == [
        "GPU g0: nic n0 PIX nvme d0 PIX numa 0 -> nic n5 PIX nvme d0 PIX numa 0",
        "GPU g1: nic n1 PIX nvme - - numa 0 -> nic n1 NODE nvme - - numa 0",
        "GPU g2: nic n9 SYS nvme - - numa 1 -> gone"]
    many = {f"g{i}": ["n", "PIX", None, None, 0] for i in range(20)}
    assert placement_changes(many, {}, limit=3)[-1] == "17 more"
