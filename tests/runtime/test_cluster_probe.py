"""`planner cluster`: ranks grouped into nodes, and a real two-process measurement that partition reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.errors import PlannerError
from planner.files.cluster import load_cluster
from planner.profiling.links import fit_allreduce
from runtime.cluster_probe import _nodes, summary

REPO = Path(__file__).resolve().parents[2]


def test_ranks_are_grouped_by_host() -> None:
    assert _nodes(["a", "a", "a"]) == (3, 1)
    assert _nodes(["a", "a", "b", "b"]) == (2, 2)
    with pytest.raises(PlannerError, match="same number of contiguous ranks"):
        _nodes(["a", "a", "b"])
    with pytest.raises(PlannerError, match="same number of contiguous ranks"):
        _nodes(["a", "b", "a", "b"])


@pytest.mark.slow
def test_planner_cluster_measures_two_processes_and_partition_reads_the_file(tmp_path: Path) -> None:
    out = tmp_path / "here.json"
    done = subprocess.run([sys.executable, "-m", "planner", "cluster", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout and "per message" in done.stdout
    assert "node: 2 ranks, " in done.stdout, done.stdout  # what the level groups, named
    cluster = load_cluster(out)
    assert cluster.num_devices == 2 and len(cluster.levels) == 1
    link = cluster.levels[0]
    assert link.latency_s > 0 and link.bandwidth_Bps > 1e7  # a real loopback: some latency, some bandwidth
    measured = json.loads(out.read_text())["measured"]
    assert measured["backend"] == "gloo" and measured["world_size"] == 2
    for one_way in (measured["one_way_s"], measured["link_only"]["one_way_s"]):  # the runtime's path, the link alone
        sizes = [size for size, _ in one_way["node"]]
        assert sizes == sorted(sizes) and len(sizes) == 4 and all(seconds > 0 for _, seconds in one_way["node"])
    alone = measured["link_only"]["levels"][0]
    assert alone["name"] == "node" and alone["latency_s"] > 0 and alone["bandwidth_Bps"] > 1e7
    # the all-reduces are priced by the ring formula fitted to the all-reduce times the file keeps (how well
    # the fit follows them is fit_allreduce's test: gloo's times at 16 KB jump 10x under load)
    assert "all-reduces priced as a ring" in done.stdout
    sizes, seconds = [size for size, _, _ in measured["allreduce_s"]], [t for _, t, _ in measured["allreduce_s"]]
    assert (link.allreduce_latency_s, link.allreduce_bandwidth_Bps) == pytest.approx(fit_allreduce(sizes, seconds, 2))
    plan = subprocess.run([sys.executable, "-m", "planner", "partition", str(REPO / "profiles" / "mlp.json"),
                           "--cluster", str(out), "--out", str(tmp_path / "plan.json")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    notes = json.loads((tmp_path / "plan.json").read_text())["notes"]
    assert notes and not any("assumed" in note for note in notes)  # a measured cluster: no note about assumed links


def test_one_process_cannot_measure_a_link(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "planner", "cluster", "--nproc", "1", "--out", str(tmp_path / "c.json")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("error: --nproc must be at least 2")
    assert not (tmp_path / "c.json").exists()


def test_the_summary_says_which_terms_price_the_all_reduces() -> None:
    link = {"name": "node", "size": 2, "bandwidth_Bps": 2e9, "latency_s": 1e-4}
    body = {"levels": [link], "measured": {"link_only": {"levels": [link]}, "allreduce_s": [[4, 3e-4, 2e-4]]}}
    assert "priced by the link's terms" in summary(body)  # the times gave no fit: none written
    fitted = {**link, "allreduce_bandwidth_Bps": 1e9, "allreduce_latency_s": 1.5e-4}
    text = summary({**body, "levels": [fitted]})
    assert "priced as a ring at 1 GB/s + 150 us" in text and "link's terms" not in text
