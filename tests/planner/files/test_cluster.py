"""Cluster descriptions: flags, files (JSON and YAML), spans of ranks, and bad values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner.costs.schedule_cost import allreduce_terms, link_terms
from planner.files.cluster import (
    CPU_LINKS,
    GPU_LINKS,
    Cluster,
    ClusterError,
    Level,
    cluster_from_dict,
    default_links,
    load_cluster,
    make_cluster,
)
from planner.errors import FileFormatError
from planner.units import parse_bandwidth, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("300GB/s", 300e9), ("25Gbit/s", 25e9 / 8), ("100Gb/s", 100e9 / 8), ("100Gbps", 100e9 / 8),
     ("40GiB/s", 40 * 2**30), ("1e9", 1e9), ("12.5 GB/s", 12.5e9)],
)
def test_bandwidth_units(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "-5GB/s", "0", "5 furlongs/s", ""])
def test_bad_bandwidths_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


def test_sizes() -> None:
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("40GiB") == 40 * 2**30
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")


def test_two_level_cluster_spans() -> None:
    cluster = make_cluster(16, 8, ["300GB/s", "25GB/s"], memory="80GB")
    assert cluster.num_devices == 16 and cluster.memory_bytes == 80 * 10**9
    assert cluster.levels[cluster.span_level(0, 7)].bandwidth_Bps == 300e9  # one node
    assert cluster.levels[cluster.span_level(7, 8)].bandwidth_Bps == 25e9  # neighbours on two nodes
    assert cluster.span_level(3, 3) == 0


def test_flat_cluster_when_all_gpus_share_a_node() -> None:
    assert make_cluster(4, None, ["10GB/s"]) == Cluster((Level("node", 4, 10e9),))


@pytest.mark.parametrize(
    ("gpus", "per_node", "bandwidths", "fragment"),
    [(0, None, ["1GB/s"], "--gpus must be at least 1"), (8, 3, ["1GB/s", "1GB/s"], "does not divide"),
     (8, 4, ["1GB/s"], "two bandwidths"), (4, None, ["-1GB/s"], "must be positive")],
)
def test_bad_flags(gpus: int, per_node: int | None, bandwidths: list[str], fragment: str) -> None:
    with pytest.raises(ClusterError, match=fragment):
        make_cluster(gpus, per_node, bandwidths)


def test_cluster_files_json_and_yaml(tmp_path: Path) -> None:
    expected = make_cluster(16, 8, ["300GB/s", "25GB/s"], memory="80GB")
    (tmp_path / "c.json").write_text(
        '{"levels": [{"name": "node", "size": 8, "bandwidth": "300GB/s"},'
        ' {"name": "cluster", "size": 2, "bandwidth": "25GB/s"}], "memory": "80GB"}'
    )
    (tmp_path / "c.yaml").write_text(
        "levels:\n  - {name: node, size: 8, bandwidth: 300GB/s}\n  - {name: cluster, size: 2, bandwidth: 25GB/s}\n"
        "memory: 80GB\n"
    )
    assert load_cluster(tmp_path / "c.json") == expected
    assert load_cluster(tmp_path / "c.yaml") == expected
    assert cluster_from_dict(expected.to_dict()) == expected


def test_bad_cluster_files_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"levels": [{"size": 0, "bandwidth": "1GB/s"}]}')
    with pytest.raises(FileFormatError, match=r"bad\.json.*has 0 members; it needs a whole number"):
        load_cluster(tmp_path / "bad.json")
    (tmp_path / "broken.yaml").write_text("levels: [")
    with pytest.raises(FileFormatError, match=r"broken\.yaml: cannot be parsed"):
        load_cluster(tmp_path / "broken.yaml")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"levels": [{"size": 1e999, "bandwidth": "1GB/s"}]}', "malformed"),
        ('{"levels": [{"size": 2.5, "bandwidth": "1GB/s"}]}', "not a whole number"),
        ('{"levels": [{"size": true, "bandwidth": "1GB/s"}]}', "not a whole number"),
        ('{"levels": [{"size": 4, "bandwidth_Bps": 300}]}', "give units"),
        ('{"levels": [{"size": 4, "bandwidth": "1GB/s"}], "memory": "80"}', "give units"),
        ('{"levels": [{"size": 4, "bandwidth": "1GB/s", "latency_s": 20}]}', "give units"),
        ('{"levels": [{"size": 4, "bandwidth": "1GB/s", "latency": "-3us"}]}', "0 or more"),
        ('{"levels": [{"size": 4, "bandwidth": "1GB/s", "latency": "soon"}]}', "cannot read duration"),
        ('{"levels": [{"size": 4, "bandwidth": "1GB/s", "allreduce_bandwidth_Bps": 300}]}', "all-reduce bandwidth"),
        ('{"levels": [{"size": 4, "bandwidth": "1GB/s", "allreduce_latency_s": 5}]}', "all-reduce latency"),
    ],
)
def test_cluster_values_that_would_mean_something_else_are_refused(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(FileFormatError, match=fragment):
        load_cluster(tmp_path / "c.json")


def test_a_bandwidth_without_units_is_refused_on_the_command_line() -> None:
    with pytest.raises(ClusterError, match="give units"):
        make_cluster(4, None, ["300"])
    assert parse_bandwidth("10GBps") == 10e9 and parse_bandwidth("10 MB/S") == 10e6


def test_latencies_per_level_from_flags_and_files(tmp_path: Path) -> None:
    cluster = make_cluster(16, 8, ["300GB/s", "25GB/s"], latencies=["10us", "0.5ms"])
    assert [level.latency_s for level in cluster.levels] == pytest.approx([1e-5, 5e-4])
    assert make_cluster(4, None, ["1GB/s"]).levels[0].latency_s == 0.0  # none given: no latency
    (tmp_path / "c.yaml").write_text(
        "levels:\n  - {name: node, size: 8, bandwidth: 300GB/s, latency: 10us}\n"
        "  - {name: cluster, size: 2, bandwidth: 25GB/s, latency: 0.5ms}\n"
    )
    assert load_cluster(tmp_path / "c.yaml") == cluster
    assert cluster_from_dict(cluster.to_dict()) == cluster
    assert "+ 10 us" in cluster.describe() and "+ 500 us" in cluster.describe()
    with pytest.raises(ClusterError, match="two latencies"):
        make_cluster(8, 4, ["1GB/s", "1GB/s"], latencies=["1us"])


def test_measured_all_reduce_terms_round_trip_and_price_all_reduces_but_not_messages(tmp_path: Path) -> None:
    cluster = make_cluster(8, 4, ["100GB/s", "10GB/s"], latencies=["5us", "50us"])
    outer = dataclasses.replace(cluster.levels[1], allreduce_bandwidth_Bps=4e9, allreduce_latency_s=2e-4)
    measured = dataclasses.replace(cluster, levels=(cluster.levels[0], outer))
    assert cluster_from_dict(measured.to_dict()) == measured
    assert "allreduce_bandwidth_Bps" not in json.dumps(cluster.to_dict())  # old files stay as they were
    (tmp_path / "c.json").write_text(json.dumps(measured.to_dict()))
    assert load_cluster(tmp_path / "c.json") == measured
    assert "all-reduce 4 GB/s + 200 us" in measured.describe()
    # ranks 0-3 share a node (no all-reduce terms: the link's); 2-5 span nodes (the measured ones)
    assert [float(x) for x in allreduce_terms(measured, 0, 3)] == pytest.approx([1e11, 5e-6])
    assert [float(x) for x in allreduce_terms(measured, 2, 5)] == pytest.approx([4e9, 2e-4])
    assert [float(x) for x in link_terms(measured, 3, 4)] == pytest.approx([1e10, 5e-5])  # messages: the link


def test_default_links_follow_the_profiles_device() -> None:
    """A CPU profile's plan trains as gloo processes; any other device (cuda, cuda:1, an imported profile's) gets
    the GPU defaults."""
    assert default_links("cpu") is CPU_LINKS and default_links("cuda:1") is GPU_LINKS is default_links("cuda")


def test_make_cluster_gives_the_node_level_the_all_reduce_terms_asked_for() -> None:
    cluster = make_cluster(4, 2, ["2.5GB/s", "1GB/s"], latencies=["130us", "200us"],
                           node_allreduce=("1.4GB/s", "180us"))
    node, outer = cluster.levels
    assert (node.reduce_bandwidth_Bps, node.reduce_latency_s) == (1.4e9, pytest.approx(180e-6))
    assert (outer.reduce_bandwidth_Bps, outer.reduce_latency_s) == (1e9, pytest.approx(200e-6))  # the link's own
    assert make_cluster(2).levels[0].allreduce_bandwidth_Bps is None


def test_a_cluster_of_one_gpu_is_described_in_the_singular() -> None:
    assert make_cluster(1).describe().startswith("1 GPU: ")
    assert make_cluster(2).describe().startswith("2 GPUs: ")
