"""Import a PipeDream `graph.txt` profile (per-node times and sizes of a DAG) as a planner `Profile`."""

from __future__ import annotations

import datetime
import heapq
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.files.cuts import boundary_cut_bytes
from planner.errors import FileFormatError
from planner.files.profile import LayerProfile, Profile

_NODE_LINE = re.compile(
    r"^(?P<id>node\d+) -- (?P<desc>.*) -- "
    r"forward_compute_time=(?P<fwd>[^,]*), backward_compute_time=(?P<bwd>[^,]*), "
    r"activation_size=(?P<act>\[[^\]]*\]|[^,\[\]]*), parameter_size=(?P<param>[^,\s]*)"
    r"(?: -- stage_id=(?P<stage>\S*))?\s*$"
)
_EDGE_LINE = re.compile(r"^\s+(?P<src>node\d+) -- (?P<dst>node\d+)\s*$")

_QUOTE_CHARS = 60
_FORMAT_FIX = "expected a PipeDream graph.txt (see the PipeDream profiles README)"


@dataclass(frozen=True)
class GraphNode:
    """One node line of a PipeDream graph.

    Times are ms per profiled mini-batch; sizes are bytes (PipeDream writes fp32 sizes);
    `activation_bytes` is the sum of the node's output sizes (a list in the file when it has
    several outputs). `stage_id` is None unless PipeDream's optimizer wrote one. `line` is the
    1-based line number of the node in the file.
    """

    node_id: str
    description: str
    fwd_ms: float
    bwd_ms: float
    activation_bytes: int
    param_bytes: int
    stage_id: int | None
    line: int

    @property
    def is_input(self) -> bool:
        """True for a data-loader node (description starting with `Input`), which is not a layer."""
        return self.description.startswith("Input")


@dataclass(frozen=True)
class Graph:
    """A parsed PipeDream graph: nodes by id and edges `(producer, consumer, line)`, duplicates removed."""

    nodes: Mapping[str, GraphNode]
    edges: tuple[tuple[str, str, int], ...]


def node_number(node_id: str) -> int:
    """Numeric part of a node id: `node_number("node12") == 12`."""
    return int(node_id[len("node"):])


def _quote(line: str) -> str:
    """The line as a repr, cut to about `_QUOTE_CHARS` characters."""
    if len(line) > _QUOTE_CHARS:
        return repr(line[:_QUOTE_CHARS]) + "..."
    return repr(line)


def _parse_number(text: str, field_name: str, path: str, line_no: int) -> float:
    """`text` as a finite, non-negative float; FileFormatError naming the field and line otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise FileFormatError(
            path, f"line {line_no}: {field_name}={text.strip()!r} is not a non-negative number", _FORMAT_FIX
        )
    return value


def _parse_bytes(text: str, field_name: str, path: str, line_no: int) -> int:
    """A size in bytes: one number, or `[a; b; ...]` summed; rounded to an int (the file writes `123.000`)."""
    stripped = text.strip()
    if stripped.startswith("["):
        parts = [part for part in stripped[1:-1].split(";") if part.strip()]
        return sum(round(_parse_number(part, field_name, path, line_no)) for part in parts)
    return round(_parse_number(stripped, field_name, path, line_no))


def _parse_node(match: re.Match[str], path: str, line_no: int) -> GraphNode:
    """Build a GraphNode from a matched node line."""
    stage = match.group("stage")
    stage_id: int | None = None
    if stage is not None:
        try:
            stage_id = int(stage)
        except ValueError:
            raise FileFormatError(
                path, f"line {line_no}: stage_id={stage!r} is not an integer", _FORMAT_FIX
            ) from None
    return GraphNode(
        node_id=match.group("id"),
        description=match.group("desc"),
        fwd_ms=_parse_number(match.group("fwd"), "forward_compute_time", path, line_no),
        bwd_ms=_parse_number(match.group("bwd"), "backward_compute_time", path, line_no),
        activation_bytes=_parse_bytes(match.group("act"), "activation_size", path, line_no),
        param_bytes=_parse_bytes(match.group("param"), "parameter_size", path, line_no),
        stage_id=stage_id,
        line=line_no,
    )


def parse_graph(text: str, path: str) -> Graph:
    """Parse the text of a PipeDream graph file; errors name `path` and the 1-based line.

    Node lines: `nodeK -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>,
    activation_size=<bytes or [a; b; ...]>, parameter_size=<bytes>[ -- stage_id=<int>]`;
    edge lines: `<TAB>nodeA -- nodeB`; blank lines are ignored. Edges may precede the nodes they
    name; an edge naming a node declared nowhere in the file is an error.
    """
    nodes: dict[str, GraphNode] = {}
    edges: dict[tuple[str, str], int] = {}
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        edge = _EDGE_LINE.match(line)
        if edge is not None:
            edges.setdefault((edge.group("src"), edge.group("dst")), line_no)
            continue
        node = _NODE_LINE.match(line)
        if node is None:
            raise FileFormatError(
                path, f"line {line_no}: neither a node nor an edge line: {_quote(line)}", _FORMAT_FIX
            )
        parsed = _parse_node(node, path, line_no)
        if parsed.node_id in nodes:
            raise FileFormatError(
                path,
                f"line {line_no}: duplicate node id {parsed.node_id} "
                f"(first declared on line {nodes[parsed.node_id].line})",
                "give every node a distinct id",
            )
        nodes[parsed.node_id] = parsed
    for (src, dst), line_no in edges.items():
        for end in (src, dst):
            if end not in nodes:
                raise FileFormatError(
                    path, f"line {line_no}: edge {src} -- {dst} names undeclared node {end}",
                    "declare every node on a node line",
                )
    return Graph(nodes=nodes, edges=tuple((src, dst, line_no) for (src, dst), line_no in edges.items()))


def _successors(graph: Graph) -> dict[str, list[str]]:
    """Consumers of each node, in file order of the edges."""
    successors: dict[str, list[str]] = {node_id: [] for node_id in graph.nodes}
    for src, dst, _ in graph.edges:
        successors[src].append(dst)
    return successors


def _cycle_member(graph: Graph, remaining: set[str]) -> str:
    """A node on a cycle, given the nodes Kahn's algorithm could not place (each has a remaining producer).

    Walking producers from any remaining node must revisit a node; the first revisited node is on a cycle.
    """
    producers: dict[str, str] = {}
    for src, dst, _ in graph.edges:
        if src in remaining and dst in remaining:
            producers.setdefault(dst, src)
    current = min(remaining, key=node_number)
    seen: set[str] = set()
    while current not in seen:
        seen.add(current)
        current = producers[current]
    return current


def topological_order(graph: Graph, path: str) -> list[str]:
    """All node ids in Kahn's order, ties broken by the smallest numeric id; FileFormatError on a cycle.

    O((V + E) log V) with a heap of ready nodes keyed by `node_number`.
    """
    successors = _successors(graph)
    in_degree = {node_id: 0 for node_id in graph.nodes}
    for _, dst, _ in graph.edges:
        in_degree[dst] += 1
    ready = [(node_number(node_id), node_id) for node_id, degree in in_degree.items() if degree == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, node_id = heapq.heappop(ready)
        order.append(node_id)
        for consumer in successors[node_id]:
            in_degree[consumer] -= 1
            if in_degree[consumer] == 0:
                heapq.heappush(ready, (node_number(consumer), consumer))
    if len(order) < len(graph.nodes):
        member = _cycle_member(graph, set(graph.nodes) - set(order))
        raise FileFormatError(
            path, f"line {graph.nodes[member].line}: node {member} is on a cycle", "the graph must be a DAG"
        )
    return order


def layer_cut_bytes(graph: Graph, layer_ids: Sequence[str]) -> list[int]:
    """`cut_bytes` of each layer of `layer_ids` (non-Input nodes in execution order).

    Every node u (Input nodes at position -1) contributes its activation bytes to boundaries
    `pos(u) <= i < max(pos(v) for consumers v of u)`.
    """
    position = {node_id: index for index, node_id in enumerate(layer_ids)}
    last_consumer = {
        node_id: position.get(node_id, -1) for node_id in graph.nodes
    }
    for src, dst, _ in graph.edges:
        last_consumer[src] = max(last_consumer[src], position.get(dst, -1))
    tensors = (
        (position.get(node_id, -1), last_consumer[node_id], node.activation_bytes)
        for node_id, node in graph.nodes.items()
    )
    return boundary_cut_bytes(len(layer_ids), tensors)


def _read_text(path: Path) -> str:
    """The file's text; FileFormatError if it is missing or not UTF-8 (naming the line of the bad byte)."""
    if not path.is_file():
        raise FileFormatError(str(path), "no such file", "check the path of the PipeDream graph.txt")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_no = data[: exc.start].count(b"\n") + 1
        raise FileFormatError(
            str(path), f"line {line_no}: not UTF-8 text (byte {exc.start})", _FORMAT_FIX
        ) from None


def profile_from_graph(
    graph: Graph, source: str, model_name: str, batch_size: int | None
) -> Profile:
    """Build the Profile of a parsed graph (see `import_pipedream` for the field mapping)."""
    order = topological_order(graph, source)
    layer_ids = [node_id for node_id in order if not graph.nodes[node_id].is_input]
    if not layer_ids:
        lines = len(graph.nodes)
        raise FileFormatError(
            source,
            f"line 1: no layer: the file's {lines} node line(s) are all Input nodes (or there are none)",
            _FORMAT_FIX,
        )
    cuts = layer_cut_bytes(graph, layer_ids)
    layers = tuple(
        LayerProfile(
            name=node_id,
            kind=graph.nodes[node_id].description,
            fwd_ms=graph.nodes[node_id].fwd_ms,
            bwd_ms=graph.nodes[node_id].bwd_ms,
            output_bytes=graph.nodes[node_id].activation_bytes,
            cut_bytes=cut,
            param_bytes=graph.nodes[node_id].param_bytes,
            saved_bytes=graph.nodes[node_id].activation_bytes,
        )
        for node_id, cut in zip(layer_ids, cuts)
    )
    inputs = [graph.nodes[node_id] for node_id in order if graph.nodes[node_id].is_input]
    return Profile(
        model_name=model_name,
        source=source,
        device="cuda",
        device_name="V100, PipeDream profile",
        torch_version="unknown",
        dtype="float32",
        batch_size=batch_size,
        threads=0,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        layers=layers,
        step_ms=sum(layer.fwd_ms + layer.bwd_ms for layer in layers),
        peak_memory_bytes=0,
        peak_memory_method="unknown",
        input_bytes=sum(node.activation_bytes for node in inputs),
        shared_params=(),
        settings={"imported_from": "pipedream", "input_load_ms": sum(node.fwd_ms for node in inputs)},
    )


def import_pipedream(
    path: str | Path, batch_size: int | None = None, model_name: str | None = None
) -> Profile:
    """Read a PipeDream `graph.txt` as a Profile; every problem raises FileFormatError naming the line.

    Layers are the non-Input nodes in Kahn's topological order (ties: smallest numeric node id
    first); `name` is the node id, `kind` the module description. Per layer, in PipeDream's units
    (ms per profiled mini-batch, bytes):
    - `fwd_ms`, `bwd_ms` = forward_compute_time, backward_compute_time;
    - `output_bytes` = activation_size (a list summed); `param_bytes` = parameter_size;
    - `saved_bytes` = activation_size as well: PipeDream's own proxy for the activation memory a
      layer keeps per in-flight micro-batch (the file has no measurement of saved tensors);
    - `cut_bytes[i]` = sum of activation_size of every node u with `pos(u) <= i < max pos(consumer of u)`,
      Input nodes at pos -1 (see `layer_cut_bytes`).
    Profile: `step_ms` = sum of the layers' fwd_ms + bwd_ms; `input_bytes` = sum of the Input nodes'
    activation sizes; `settings["input_load_ms"]` = sum of the Input nodes' forward times (data
    loading); `model_name` defaults to the file stem; `batch_size` stays None unless given; the
    memory peak is unknown (0). stage_id suffixes are validated and ignored.
    """
    path = Path(path)
    source = str(path)
    graph = parse_graph(_read_text(path), source)
    return profile_from_graph(graph, source, model_name if model_name is not None else path.stem, batch_size)
