"""Cluster: devices in nested levels (GPUs in a node, nodes in a cluster) with per-level links.

Ranks are numbered so that each group of a level is a contiguous range: with 8 GPUs per node,
ranks 0-7 are node 0. Two ranks talk over the link of the innermost level whose group holds
both: a message of b bytes takes latency_s + b / bandwidth_Bps. A set of ranks spanning
[first, last] is limited by the slowest link inside that range.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from planner.errors import FileFormatError, PlannerError
from planner.units import parse_bandwidth, parse_bytes, parse_seconds, plural

MIN_BANDWIDTH_BPS = 1e6  # 1 MB/s: anything slower is a number given without units
MAX_LATENCY_S = 1.0  # a second per message: anything longer is a number given in other units
MIN_MEMORY_BYTES = 10**6
MAX_LEVEL_SIZE = 10**6


class ClusterError(PlannerError):
    """A cluster description that cannot work (no GPUs, bad bandwidth, K not dividing N, ...)."""


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: `size` groups of the level below form one group of this level.

    `bandwidth_Bps` is the bandwidth between two devices whose innermost common group is at this
    level, in bytes per second; `latency_s` the fixed time of each message between them, seconds.
    `allreduce_bandwidth_Bps` and `allreduce_latency_s`: the terms of the ring formula
    2 (r - 1) (W / (r bw) + lat) that fit all-reduces measured over ranks whose innermost common group
    is at this level (`planner cluster` fits them; a library's all-reduce is rarely the ring of the
    point-to-point links: gloo's on one CPU host took 1.9-2.7x that); None: the link's own.
    """

    name: str
    size: int
    bandwidth_Bps: float
    latency_s: float = 0.0
    allreduce_bandwidth_Bps: float | None = None
    allreduce_latency_s: float | None = None

    @property
    def reduce_bandwidth_Bps(self) -> float:
        """The bandwidth all-reduces at this level are priced at: the measured fit, else the link's."""
        return self.bandwidth_Bps if self.allreduce_bandwidth_Bps is None else self.allreduce_bandwidth_Bps

    @property
    def reduce_latency_s(self) -> float:
        """The latency per ring message all-reduces at this level are priced at (as `reduce_bandwidth_Bps`)."""
        return self.latency_s if self.allreduce_latency_s is None else self.allreduce_latency_s


@dataclass(frozen=True)
class Cluster:
    """Levels innermost first (e.g. GPUs per node, then nodes); `memory_bytes` per device or None."""

    levels: tuple[Level, ...]
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.levels:
            raise ClusterError("a cluster needs at least one level")
        for level in self.levels:
            _check_reduce_terms(level)
            if isinstance(level.size, bool) or not isinstance(level.size, int) or not 1 <= level.size <= MAX_LEVEL_SIZE:
                raise ClusterError(
                    f"level {level.name!r} has {level.size!r} members; it needs a whole number from 1 to {MAX_LEVEL_SIZE}"
                )
            if not MIN_BANDWIDTH_BPS <= level.bandwidth_Bps < math.inf:
                raise ClusterError(
                    f"level {level.name!r} has bandwidth {level.bandwidth_Bps:g} B/s; below {MIN_BANDWIDTH_BPS:g} B/s "
                    "is not a real interconnect: give units, e.g. 300GB/s or 25Gbit/s"
                )
            if not 0.0 <= level.latency_s < MAX_LATENCY_S:
                raise ClusterError(
                    f"level {level.name!r} has latency {level.latency_s:g} s; it must be 0 or more and below "
                    f"{MAX_LATENCY_S:g} s per message: give units, e.g. 20us or 0.5ms"
                )
        if self.memory_bytes is not None and not MIN_MEMORY_BYTES <= self.memory_bytes < 2**63:
            raise ClusterError(
                f"device memory of {self.memory_bytes!r} bytes is not plausible; give units, e.g. 80GB"
            )

    def with_memory(self, memory: str | int | None) -> "Cluster":
        """This cluster with `memory` per device ("80GB", bytes; None: as it is), e.g. a measured cluster file
        (whose CPU processes have no device memory to measure) under a limit given on the command line."""
        return self if memory is None else dataclasses.replace(self, memory_bytes=_memory(memory))

    @property
    def num_devices(self) -> int:
        """Total number of devices: the product of the level sizes."""
        return math.prod(level.size for level in self.levels)

    def group_sizes(self) -> list[int]:
        """Devices per group at each level: [size0, size0*size1, ...]."""
        sizes, running = [], 1
        for level in self.levels:
            running *= level.size
            sizes.append(running)
        return sizes

    def span_level(self, first_rank: int, last_rank: int) -> int:
        """Index of the innermost level whose one group holds every rank in [first_rank, last_rank]."""
        for index, group in enumerate(self.group_sizes()):
            if first_rank // group == last_rank // group:
                return index
        return len(self.levels) - 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description; inverse of `cluster_from_dict`. The all-reduce terms only where set."""
        levels = []
        for lv in self.levels:
            entry: dict[str, Any] = {"name": lv.name, "size": lv.size, "bandwidth_Bps": lv.bandwidth_Bps,
                                     "latency_s": lv.latency_s}
            if lv.allreduce_bandwidth_Bps is not None:
                entry["allreduce_bandwidth_Bps"] = lv.allreduce_bandwidth_Bps
            if lv.allreduce_latency_s is not None:
                entry["allreduce_latency_s"] = lv.allreduce_latency_s
            levels.append(entry)
        return {"levels": levels, "memory_bytes": self.memory_bytes}

    def describe(self) -> str:
        """One line, e.g. '16 GPUs: 8 per node at 300 GB/s, 2 nodes at 25 GB/s, 80.0 GB each'."""
        parts = [f"{lv.size} per {lv.name} at {lv.bandwidth_Bps / 1e9:.3g} GB/s"
                 + (f" + {lv.latency_s * 1e6:.3g} us" if lv.latency_s else "")
                 + (f" (all-reduce {lv.reduce_bandwidth_Bps / 1e9:.3g} GB/s + {lv.reduce_latency_s * 1e6:.3g} us)"
                    if lv.allreduce_bandwidth_Bps is not None or lv.allreduce_latency_s is not None else "")
                 for lv in self.levels]
        memory = "" if self.memory_bytes is None else f", {self.memory_bytes / 1e9:.3g} GB each"
        return f"{plural(self.num_devices, 'GPU')}: " + ", ".join(parts) + memory


def _check_reduce_terms(level: Level) -> None:
    """ClusterError unless the level's all-reduce terms, where set, are in the ranges of its link's."""
    if level.allreduce_bandwidth_Bps is not None and not MIN_BANDWIDTH_BPS <= level.allreduce_bandwidth_Bps < math.inf:
        raise ClusterError(f"level {level.name!r} has all-reduce bandwidth {level.allreduce_bandwidth_Bps:g} B/s; "
                           f"it must be at least {MIN_BANDWIDTH_BPS:g} B/s (bytes per second)")
    if level.allreduce_latency_s is not None and not 0.0 <= level.allreduce_latency_s < MAX_LATENCY_S:
        raise ClusterError(f"level {level.name!r} has all-reduce latency {level.allreduce_latency_s:g} s; it must be "
                           f"0 or more and below {MAX_LATENCY_S:g} s per message (seconds)")


@dataclass(frozen=True)
class DefaultLinks:
    """The links `planner partition --gpus` assumes where neither a cluster file nor the link flags give them,
    for one kind of device (`default_links`): bandwidths and latencies per message within a node and between
    nodes, and the all-reduce's ring terms within a node (bandwidth, latency; None: the link's own)."""

    kind: str
    bandwidths: tuple[str, str]
    latencies: tuple[str, str]
    allreduce: tuple[str, str] | None = None


GPU_LINKS = DefaultLinks("GPUs", ("300GB/s", "25GB/s"), ("0us", "0us"))
# What `planner cluster` measured for 2 gloo processes on the 2-core development machine (2026-11-27: links
# 2.63 GB/s + 127 us a message, all-reduce ring terms 1.40 GB/s + 180 us; earlier days 2.0-2.9 GB/s + 53-243 us).
# Between hosts: a 10 Gbit/s Ethernet's payload rate with a TCP round trip's latency, not measured here.
CPU_LINKS = DefaultLinks("CPU processes", ("2.5GB/s", "1GB/s"), ("130us", "200us"), ("1.4GB/s", "180us"))


def default_links(device: str) -> DefaultLinks:
    """The links assumed for a profile measured on `device` ("cpu", "cuda:0", ...): a CPU profile trains as gloo
    processes, whose messages cost a hundred times what a GPU link's default says (300 GB/s and no latency: a CPU
    pipeline's transfers measured x158-x261 their prediction, its all-reduces x284-x654)."""
    return CPU_LINKS if device.split(":")[0] == "cpu" else GPU_LINKS


def assumed_links(cluster: Cluster, bandwidth_given: bool, latency_given: bool, kind: str = GPU_LINKS.kind) -> str:
    """A note naming the link values of `cluster` that are defaults for `kind` (`DefaultLinks.kind`) rather than
    given ("" when both were given), the all-reduce terms of a level that has its own (only defaults set them
    here), and how to measure them."""
    assumed = []
    if not bandwidth_given:
        assumed.append("bandwidth " + ", ".join(f"{lv.bandwidth_Bps / 1e9:.3g} GB/s" for lv in cluster.levels))
    if not latency_given:
        assumed.append("latency " + ", ".join(f"{lv.latency_s * 1e6:.3g} us" for lv in cluster.levels))
    if not assumed:
        return ""
    reducing = "".join(f", and all-reduces at {lv.reduce_bandwidth_Bps / 1e9:.3g} GB/s + {lv.reduce_latency_s * 1e6:.3g}"
                       f" us a ring step within a {lv.name}" for lv in cluster.levels
                       if lv.allreduce_bandwidth_Bps is not None)
    return (f"assumed {' and '.join(assumed)} per level{reducing} (defaults for {kind}, not measured): transfer "
            "times may be far off; measure this machine with `planner cluster` and pass --cluster")


def make_cluster(
    gpus: int, gpus_per_node: int | None = None, bandwidths: Sequence[str | float] = GPU_LINKS.bandwidths,
    memory: str | int | None = None, latencies: Sequence[str | float] = (),
    node_allreduce: tuple[str | float, str | float] | None = None,
) -> Cluster:
    """The cluster of the `--gpus/--gpus-per-node/--bandwidth/--latency/--memory` flags.

    With `gpus_per_node` None or equal to `gpus`, the cluster is flat (one node) at the first
    bandwidth; otherwise GPUs within a node use the first bandwidth and nodes the second.
    `latencies` pair with the bandwidths the same way (none given: 0 s per message).
    `node_allreduce`: the all-reduce's (bandwidth, latency) within a node (`Level.allreduce_bandwidth_Bps`; None:
    the link's own).
    """
    if gpus < 1:
        raise ClusterError(f"--gpus must be at least 1, got {gpus}")
    per_node = gpus if gpus_per_node is None else gpus_per_node
    if per_node < 1:
        raise ClusterError(f"--gpus-per-node must be at least 1, got {per_node}")
    if gpus % per_node:
        raise ClusterError(f"--gpus-per-node {per_node} does not divide --gpus {gpus}")
    rates = [_bandwidth(value) for value in bandwidths]
    if not rates:
        raise ClusterError("--bandwidth needs at least one value")
    delays = [_latency(value) for value in latencies] or [0.0]
    memory_bytes = None if memory is None else _memory(memory)
    reduce_rate, reduce_delay = (None, None) if node_allreduce is None else (
        _bandwidth(node_allreduce[0]), _latency(node_allreduce[1]))
    node = Level("node", per_node, rates[0], delays[0], reduce_rate, reduce_delay)
    if per_node == gpus:
        return Cluster((node,), memory_bytes)
    if len(rates) < 2:
        raise ClusterError(
            f"{gpus // per_node} nodes need two bandwidths (within a node, between nodes), got {len(rates)}"
        )
    if len(delays) < 2 and latencies:
        raise ClusterError(f"{gpus // per_node} nodes need two latencies (within a node, between nodes), got 1")
    outer_delay = delays[1] if len(delays) > 1 else delays[0]
    return Cluster((node, Level("cluster", gpus // per_node, rates[1], outer_delay)), memory_bytes)


def _bandwidth(value: str | float) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not value > 0:
            raise ClusterError(f"bandwidth {value} must be positive")
        return float(value)
    try:
        return parse_bandwidth(value)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None


def _latency(value: str | float) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return parse_seconds(value)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None


def _memory(value: str | int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ClusterError(f"memory {value} must be positive")
        return value
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None


def cluster_from_dict(body: dict[str, Any], source: str = "<dict>") -> Cluster:
    """A Cluster from `Cluster.to_dict()` output or a hand-written file body.

    Hand-written files may give `bandwidth` as text ("300GB/s") instead of `bandwidth_Bps`,
    `latency` as text ("20us") instead of `latency_s` (neither: 0), and `memory` as text ("80GB")
    instead of `memory_bytes`; `allreduce_bandwidth_Bps` and `allreduce_latency_s` are optional. Other
    fields (e.g. the measurements `planner cluster` writes) are kept out of the Cluster.
    """
    try:
        levels = []
        for entry in body["levels"]:
            rate = entry["bandwidth_Bps"] if "bandwidth_Bps" in entry else _bandwidth(str(entry["bandwidth"]))
            delay = float(entry["latency_s"]) if "latency_s" in entry else _latency(str(entry.get("latency", 0.0)))
            reduce_rate, reduce_delay = entry.get("allreduce_bandwidth_Bps"), entry.get("allreduce_latency_s")
            levels.append(Level(str(entry.get("name", f"level{len(levels)}")), _whole(entry["size"]), float(rate),
                                delay, None if reduce_rate is None else float(reduce_rate),
                                None if reduce_delay is None else float(reduce_delay)))
        if "memory_bytes" in body:
            memory = None if body["memory_bytes"] is None else _whole(body["memory_bytes"])
        else:
            memory = None if body.get("memory") is None else _memory(str(body["memory"]))
        return Cluster(tuple(levels), memory)
    except KeyError as exc:
        raise FileFormatError(source, f"cluster is missing the field {exc.args[0]!r}",
                              'expected {"levels": [{"name", "size", "bandwidth"}], "memory"}') from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise FileFormatError(source, f"cluster has a malformed field: {exc}") from None
    except ClusterError as exc:
        raise FileFormatError(source, str(exc)) from None


def _whole(value: Any) -> int:
    """An int from a file field: whole numbers only (2.0 passes, 2.9 and true do not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file: JSON, or YAML (.yaml/.yml) with the same fields."""
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(str(path), "no such file", "check the path of the cluster file")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            body = yaml.safe_load(text)
        else:
            body = json.loads(text)
    except Exception as exc:  # yaml.YAMLError or json.JSONDecodeError
        raise FileFormatError(str(path), f"cannot be parsed: {str(exc).splitlines()[0]}") from None
    if not isinstance(body, dict):
        raise FileFormatError(str(path), "expected a mapping with 'levels'")
    return cluster_from_dict(body, str(path))
