"""`fleetmend.drift.nccl_env_findings`: a job's NCCL environment against the GPU-local NICs of a node's fingerprint
(read by the real reader from synthesised DGX H100-shaped roots), with NCCL's documented filter syntax."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.inventory import read_fingerprint
from fleetmend.drift import MAX_NCCL_FINDINGS_PER_NODE, nccl_env_findings, parse_gdr_level, parse_nccl_filter
from fleetmend.fingerprint import Fingerprint
from tests.fixtures.hosts.synth import HostSpec, build_host

ALL8 = "=" + ",".join(f"mlx5_{i}" for i in range(8))


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Fingerprint:
    return read_fingerprint(build_host(tmp_path_factory.mktemp("good")), "c", "n1")


def test_nccl_filter_syntax() -> None:
    """NCCL env docs: prefixes by default, `=` exact, `^` excludes (`^=` exact exclude), `:port` per HCA."""
    f = parse_nccl_filter("mlx5")
    assert f.selects("mlx5_10") and not f.selects("bnxt_re0")
    f = parse_nccl_filter("=mlx5_1")
    assert f.selects("mlx5_1") and not f.selects("mlx5_10")
    f = parse_nccl_filter("^=mlx5_1,mlx5_4")
    assert not f.selects("mlx5_1") and not f.selects("mlx5_4") and f.selects("mlx5_10")
    f = parse_nccl_filter("=mlx5_0:1,mlx5_1:1")
    assert f.selects("mlx5_0", 1) and not f.selects("mlx5_0", 2) and f.selects("mlx5_0")
    f = parse_nccl_filter("^mlx5_0:2")
    assert f.selects("mlx5_0", 1) and not f.selects("mlx5_0", 2) and f.selects("mlx5_0")  # port 1 stays
    assert parse_nccl_filter("").selects("anything") and parse_nccl_filter(None).selects("x")
    with pytest.raises(ValueError, match="port"):
        parse_nccl_filter("mlx5_0:one")
    assert parse_gdr_level("pxb") == ("PXB", 1) and parse_gdr_level("0")[0] == "LOC"
    with pytest.raises(ValueError):
        parse_gdr_level("NODE")


def test_the_right_env_has_no_findings(good: Fingerprint) -> None:
    assert nccl_env_findings({"NCCL_IB_HCA": ALL8, "NCCL_SOCKET_IFNAME": "=eno1", "NCCL_NET_GDR_LEVEL": "PIX"},
                             good) == []
    assert nccl_env_findings({"NCCL_IB_HCA": "mlx5"}, good) == []


def test_a_left_out_gpu_nic_names_the_gpu_the_nic_expected_and_what_it_gets(good: Fingerprint) -> None:
    got = nccl_env_findings({"NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2,mlx5_4,mlx5_5,mlx5_6,mlx5_7"}, good)
    assert [(f.variable, f.gpu, f.expected) for f in got] == [("NCCL_IB_HCA", "0000:61:00.0", "mlx5_3 (PIX, NUMA 0)")]
    assert "same NUMA node 0" in got[0].why
    # excluding socket 0's four NICs: GPUs 0-3 cross the socket interconnect
    got = nccl_env_findings({"NCCL_IB_HCA": "^=mlx5_0,mlx5_1,mlx5_2,mlx5_3"}, good)
    assert [f.gpu for f in got] == ["0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0"]
    assert all("SYS" in f.why and "NUMA node 1" in f.why for f in got)


def test_names_that_match_nothing_and_a_filter_selecting_none(good: Fingerprint) -> None:
    got = nccl_env_findings({"NCCL_IB_HCA": "mlx4"}, good)
    assert [f.why for f in got] == ["'mlx4' matches no RDMA device here",
                                    "selects no RDMA device: NCCL falls back to TCP sockets"]
    got = nccl_env_findings({"NCCL_SOCKET_IFNAME": "=eth0"}, good)
    assert [f.variable for f in got] == ["NCCL_SOCKET_IFNAME"] and "eno1" in got[0].expected
    assert nccl_env_findings({"NCCL_SOCKET_IFNAME": "^docker,lo"}, good) == []


def test_a_storage_nic_named_and_the_gdr_level(tmp_path: Path) -> None:
    """GPU 0's rail cabled to the other socket: that NIC is storage by role (no GPU is PIX/PXB to it); a prefix
    filter then selects it, and a GDR level below a GPU's path turns GPUDirect RDMA off for that GPU."""
    fp = read_fingerprint(build_host(tmp_path / "swap", HostSpec(nic_numa_swap=True)), "c", "n2")
    got = nccl_env_findings({"NCCL_IB_HCA": "mlx5"}, fp)
    assert [(f.gpu, f.given) for f in got] == [(None, "mlx5_0 (storage, 0000:f1:00.0)")]
    got = nccl_env_findings({"NCCL_NET_GDR_LEVEL": "PIX"}, fp)  # GPU 0 reaches GPU 1's NIC over NODE (PHB to NCCL)
    assert [(f.gpu, f.expected) for f in got] == [("0000:1b:00.0", "at least PHB")]
    got = nccl_env_findings({"NCCL_IB_GDR_LEVEL": "0"}, fp)
    assert len(got) == 1 and got[0].gpu is None and "every GPU" in got[0].why
    assert "LOC, PIX" in nccl_env_findings({"NCCL_NET_GDR_LEVEL": "near"}, fp)[0].expected


def test_findings_per_node_are_bounded(good: Fingerprint) -> None:
    env = {"NCCL_IB_HCA": "=mlx5_9,mlx5_10,mlx5_11,mlx5_12,mlx5_13,mlx5_14,mlx5_15,mlx5_16,mlx5_17,mlx5_18,"
                          "mlx5_19,mlx5_20,mlx5_21,mlx5_22,mlx5_23,mlx5_24,mlx5_25"}
    got = nccl_env_findings(env, good)
    assert len(got) == MAX_NCCL_FINDINGS_PER_NODE and got[-1].why.endswith("more findings left out")
