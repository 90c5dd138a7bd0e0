"""Tests of the PipeDream graph.txt importer (planner.files.pipedream)."""

from __future__ import annotations

import datetime
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import FileFormatError
from planner.files.pipedream import import_pipedream, parse_graph, profile_from_graph
from planner.files.profile import load_profile

DATA = Path(__file__).resolve().parents[2] / "data"
SKIP_GRAPH = DATA / "pipedream_skip.txt"
REAL_DIR = Path(__file__).resolve().parents[4] / "shared" / "pipedream-profiles"
REAL_MODELS = (
    "alexnet", "densenet121", "gnmt", "gnmt_large", "inception_v3", "nasnetalarge", "nasnetamobile",
    "resnet101", "resnet18", "resnet50", "resnext101", "resnext50", "squeezenet1_0", "vgg16",
)

NODE_TAIL = "forward_compute_time=1.0, backward_compute_time=2.0, activation_size=8.0, parameter_size=4.0"


def node_line(number: int, description: str = "Linear(2, 2)", tail: str = NODE_TAIL) -> str:
    """A well-formed node line."""
    return f"node{number} -- {description} -- {tail}"


def write_graph(tmp_path: Path, lines: list[str], name: str = "graph.txt") -> Path:
    """Write `lines` as a graph file and return its path."""
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- the hand-made graph -------------------------------------------------------------------------

def test_skip_graph_layers_in_topological_order() -> None:
    profile = import_pipedream(SKIP_GRAPH)
    # node1 is the Input; node9 and node10 become ready together after node5: numeric tie-break puts
    # node9 first (a string sort would put node10 first).
    assert [layer.name for layer in profile.layers] == ["node2", "node3", "node4", "node5", "node9", "node10", "node11"]
    assert [layer.kind for layer in profile.layers] == [
        "Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))",
        "ReLU(inplace)",
        "LSTM(8, 4, batch_first=True)",
        "__getitem__(0)",
        "Add",
        "Linear(in_features=8, out_features=4, bias=True)",
        "Add",
    ]


def test_skip_graph_cut_bytes_by_hand() -> None:
    profile = import_pipedream(SKIP_GRAPH)
    # Positions: node1 (Input) -1, node2 0, node3 1, node4 2, node5 3, node9 4, node10 5, node11 6.
    # Tensor (bytes): producer pos -> last consumer pos, boundaries crossed (pos <= i < last):
    #   node1  (64):   -1 -> 2 (node2, node4)     crosses 0, 1
    #   node2  (640):   0 -> 1 (node3)            crosses 0
    #   node3  (800):   1 -> 4 (node4, node9)     crosses 1, 2, 3   <- the skip connection
    #   node4  (340):   2 -> 3 (node5)            crosses 2          (list [300; 20; 20] summed)
    #   node5  (300):   3 -> 5 (node9, node10)    crosses 3, 4
    #   node9  (200):   4 -> 6 (node11)           crosses 4, 5
    #   node10 (100):   5 -> 6 (node11)           crosses 5
    #   node11 (200):   no consumer               crosses nothing
    # cut[0] = 64 + 640 = 704;  cut[1] = 64 + 800 = 864;  cut[2] = 800 + 340 = 1140;
    # cut[3] = 800 + 300 = 1100; cut[4] = 300 + 200 = 500; cut[5] = 200 + 100 = 300; cut[6] = 0.
    assert [layer.cut_bytes for layer in profile.layers] == [704, 864, 1140, 1100, 500, 300, 0]


def test_skip_graph_layer_fields_and_profile_fields() -> None:
    profile = import_pipedream(SKIP_GRAPH, batch_size=32)
    assert [layer.output_bytes for layer in profile.layers] == [640, 800, 340, 300, 200, 100, 200]
    assert [layer.saved_bytes for layer in profile.layers] == [640, 800, 340, 300, 200, 100, 200]
    assert [layer.param_bytes for layer in profile.layers] == [896, 0, 1024, 0, 0, 144, 0]
    assert [layer.fwd_ms for layer in profile.layers] == [1.25, 0.5, 3.0, 0.0, 0.125, 0.75, 0.0]
    assert [layer.bwd_ms for layer in profile.layers] == [2.5, 0.5, 4.5, 0.0, 0.25, 1.5, 0.0]
    # step = fwd 5.625 + bwd 9.25
    assert profile.step_ms == pytest.approx(14.875)
    assert profile.model_name == "pipedream_skip"
    assert profile.source == str(SKIP_GRAPH)
    assert profile.device == "cuda"
    assert profile.device_name == "V100, PipeDream profile"
    assert profile.torch_version == "unknown"
    assert profile.dtype == "float32"
    assert profile.batch_size == 32
    assert profile.threads == 0
    assert datetime.datetime.fromisoformat(profile.created).date() == datetime.datetime.now(datetime.timezone.utc).date()
    assert profile.peak_memory_bytes == 0
    assert profile.peak_memory_method == "unknown"
    assert profile.input_bytes == 64
    assert profile.shared_params == ()
    assert profile.settings == {"imported_from": "pipedream", "input_load_ms": 2.5}


def test_model_name_and_batch_size_defaults() -> None:
    assert import_pipedream(SKIP_GRAPH).batch_size is None
    assert import_pipedream(str(SKIP_GRAPH), model_name="toy").model_name == "toy"


def test_order_is_deterministic_under_line_shuffles(tmp_path: Path) -> None:
    lines = [line for line in SKIP_GRAPH.read_text(encoding="utf-8").splitlines() if line.strip()]
    reference = import_pipedream(SKIP_GRAPH)
    assert import_pipedream(SKIP_GRAPH) == reference
    rng = random.Random(1234)
    for attempt in range(5):
        rng.shuffle(lines)
        shuffled = import_pipedream(write_graph(tmp_path, lines, f"shuffled{attempt}.txt"))
        assert shuffled.layers == reference.layers


def test_round_trip_through_profile_file(tmp_path: Path) -> None:
    profile = import_pipedream(SKIP_GRAPH, batch_size=8)
    saved = profile.save(tmp_path / "skip.profile.json")
    assert load_profile(saved) == profile


def test_blank_lines_and_stage_ids_are_accepted(tmp_path: Path) -> None:
    path = write_graph(tmp_path, [
        "", node_line(1, "Input"), "   ", node_line(2, tail=NODE_TAIL + " -- stage_id=0"),
        "\tnode1 -- node2", "",
    ])
    profile = import_pipedream(path)
    assert [layer.name for layer in profile.layers] == ["node2"]
    assert profile.layers[0].cut_bytes == 0


def test_node_without_edges_is_a_layer(tmp_path: Path) -> None:
    path = write_graph(tmp_path, [node_line(1, "Input"), node_line(3), node_line(2), "\tnode1 -- node3"])
    profile = import_pipedream(path)
    # Kahn starts with node1 and node2 ready: node1 (Input) first, then node2, then node3.
    assert [layer.name for layer in profile.layers] == ["node2", "node3"]
    # The input (8 bytes) is consumed by node3 at position 1: it crosses boundary 0.
    assert [layer.cut_bytes for layer in profile.layers] == [8, 0]


# --- errors ----------------------------------------------------------------------------------------

def assert_format_error(path: Path, *fragments: str) -> FileFormatError:
    """Import `path`, expect a FileFormatError naming the file and containing every fragment."""
    with pytest.raises(FileFormatError) as info:
        import_pipedream(path)
    error = info.value
    assert error.path == str(path)
    assert str(path) in str(error)
    for fragment in fragments:
        assert fragment in error.problem
    return error


def test_missing_file(tmp_path: Path) -> None:
    assert_format_error(tmp_path / "absent.txt", "no such file")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "binary.txt"
    path.write_bytes((node_line(1, "Input") + "\n").encode() + b"node2 -- Lin\xff\xfeear -- x\n")
    assert_format_error(path, "line 2", "UTF-8")


def test_line_neither_node_nor_edge_is_quoted_briefly(tmp_path: Path) -> None:
    garbage = "this is not a graph line " + "x" * 200
    path = write_graph(tmp_path, [node_line(1, "Input"), node_line(2), garbage])
    error = assert_format_error(path, "line 3", "this is not a graph line")
    assert "x" * 61 not in error.problem
    assert len(error.problem) < 160


@pytest.mark.parametrize("tail, field", [
    ("forward_compute_time=abc, backward_compute_time=2.0, activation_size=8.0, parameter_size=4.0",
     "forward_compute_time"),
    ("forward_compute_time=1.0, backward_compute_time=, activation_size=8.0, parameter_size=4.0",
     "backward_compute_time"),
    ("forward_compute_time=1.0, backward_compute_time=2.0, activation_size=[8.0; x], parameter_size=4.0",
     "activation_size"),
    ("forward_compute_time=1.0, backward_compute_time=2.0, activation_size=8.0, parameter_size=nan",
     "parameter_size"),
    ("forward_compute_time=1.0, backward_compute_time=2.0, activation_size=-8.0, parameter_size=4.0",
     "activation_size"),
    (NODE_TAIL + " -- stage_id=two", "stage_id"),
])
def test_bad_number(tmp_path: Path, tail: str, field: str) -> None:
    path = write_graph(tmp_path, [node_line(1, "Input"), node_line(2, tail=tail), "\tnode1 -- node2"])
    assert_format_error(path, "line 2", field)


def test_duplicate_node_id(tmp_path: Path) -> None:
    path = write_graph(tmp_path, [node_line(1, "Input"), node_line(2), node_line(2, "ReLU()")])
    assert_format_error(path, "line 3", "duplicate", "node2", "line 2")


def test_edge_naming_undeclared_node(tmp_path: Path) -> None:
    path = write_graph(tmp_path, [node_line(1, "Input"), node_line(2), "\tnode1 -- node2", "\tnode2 -- node7"])
    assert_format_error(path, "line 4", "node7")


def test_cycle_names_a_node_on_it(tmp_path: Path) -> None:
    # node2 -> node5 -> node6 -> node7 -> node5 is a cycle; node3 hangs below it and has the smallest id
    # among the nodes left over, but is not on the cycle.
    lines = [node_line(1, "Input"), node_line(2), node_line(3), node_line(5), node_line(6), node_line(7),
             "\tnode1 -- node2", "\tnode2 -- node5", "\tnode5 -- node6", "\tnode6 -- node7",
             "\tnode7 -- node5", "\tnode7 -- node3"]
    error = assert_format_error(write_graph(tmp_path, lines), "cycle")
    line_of = {"node5": 4, "node6": 5, "node7": 6}
    named = [node for node in line_of if f"node {node} " in error.problem]
    assert len(named) == 1
    assert f"line {line_of[named[0]]}" in error.problem


def test_self_loop_is_a_cycle(tmp_path: Path) -> None:
    path = write_graph(tmp_path, [node_line(1, "Input"), node_line(2), "\tnode1 -- node2", "\tnode2 -- node2"])
    assert_format_error(path, "line 2", "node2", "cycle")


@pytest.mark.parametrize("lines", [[], [node_line(1, "Input")], [node_line(1, "Input0"), node_line(2, "Input1")]])
def test_no_layer(tmp_path: Path, lines: list[str]) -> None:
    assert_format_error(write_graph(tmp_path, lines), "line", "no layer")


# --- random DAGs against brute force ---------------------------------------------------------------

def reference_order(numbers: list[int], edges: set[tuple[int, int]]) -> list[int]:
    """O(n^2) Kahn: repeatedly take the smallest-numbered node whose producers are all placed."""
    placed: list[int] = []
    left = set(numbers)
    while left:
        ready = [n for n in left if all(src not in left for src, dst in edges if dst == n)]
        chosen = min(ready)
        placed.append(chosen)
        left.remove(chosen)
    return placed


def reference_cuts(layers: list[int], inputs: set[int], sizes: dict[int, int],
                   edges: set[tuple[int, int]]) -> list[int]:
    """O(n^2) definition: cut[i] = sum of sizes of u with pos(u) <= i < max pos of u's consumers."""
    pos = {n: i for i, n in enumerate(layers)} | {n: -1 for n in inputs}
    cuts = []
    for i in range(len(layers)):
        total = 0
        for u in pos:
            consumers = [pos[dst] for src, dst in edges if src == u]
            if consumers and pos[u] <= i < max(consumers):
                total += sizes[u]
        cuts.append(total)
    return cuts


@st.composite
def random_dags(draw: st.DrawFn) -> tuple[list[int], set[int], dict[int, int], set[tuple[int, int]]]:
    """(node numbers in a hidden topological rank, Input numbers, sizes, edges) of a random small DAG."""
    count = draw(st.integers(min_value=1, max_value=9))
    numbers = draw(st.permutations(list(range(1, 13))))[:count]
    num_inputs = draw(st.integers(min_value=0, max_value=min(2, count - 1)))
    inputs = set(numbers[:num_inputs])
    sizes = {n: draw(st.integers(min_value=0, max_value=1000)) for n in numbers}
    pairs = [(numbers[a], numbers[b]) for a in range(count) for b in range(a + 1, count)
             if numbers[b] not in inputs]
    edges = set(draw(st.lists(st.sampled_from(pairs), max_size=15))) if pairs else set()
    return numbers, inputs, sizes, edges


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.randoms(use_true_random=False))
def test_random_dags_match_brute_force(
    dag: tuple[list[int], set[int], dict[int, int], set[tuple[int, int]]], rng: random.Random
) -> None:
    numbers, inputs, sizes, edges = dag
    lines = [node_line(n, "Input" if n in inputs else f"Op{n}(a=1, b=(2, 3))",
                       f"forward_compute_time=0.5, backward_compute_time=1.0, "
                       f"activation_size={sizes[n]}.0, parameter_size={n}.0") for n in numbers]
    lines += [f"\tnode{src} -- node{dst}" for src, dst in edges]
    rng.shuffle(lines)
    graph = parse_graph("\n".join(lines), "<random>")
    expected_layers = [n for n in reference_order(numbers, edges) if n not in inputs]
    profile = profile_from_graph(graph, "<random>", "random", None)
    assert [layer.name for layer in profile.layers] == [f"node{n}" for n in expected_layers]
    assert [layer.cut_bytes for layer in profile.layers] == reference_cuts(expected_layers, inputs, sizes, edges)
    assert profile.input_bytes == sum(sizes[n] for n in inputs)


# --- the real PipeDream profiles ---------------------------------------------------------------------

def file_facts(path: Path) -> tuple[int, int]:
    """(number of non-Input nodes, sum of parameter_size) read from the file by plain string splitting."""
    layers = 0
    params = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("node"):
            continue
        if not line.split(" -- ")[1].startswith("Input"):
            layers += 1
        params += round(float(line.split("parameter_size=")[1].split()[0]))
    return layers, params


@pytest.mark.parametrize("model", REAL_MODELS)
def test_real_profile(model: str) -> None:
    path = REAL_DIR / f"{model}.txt"
    if not REAL_DIR.is_dir():
        pytest.skip(f"{REAL_DIR} is absent")
    profile = import_pipedream(path)
    num_layers, total_params = file_facts(path)
    assert profile.num_layers == num_layers
    assert profile.total_param_bytes == total_params
    assert all(layer.cut_bytes >= 0 for layer in profile.layers)
    assert profile.layers[-1].cut_bytes == 0
    assert profile.model_name == model
    assert profile.step_ms == pytest.approx(profile.total_fwd_ms + profile.total_bwd_ms)


def test_real_chain_vgg16_cuts_are_activations() -> None:
    if not REAL_DIR.is_dir():
        pytest.skip(f"{REAL_DIR} is absent")
    profile = import_pipedream(REAL_DIR / "vgg16.txt")
    layers = profile.layers
    # vgg16 is a chain except for the flatten: node32 (MaxPool2d) feeds node33 (Size(0), 4 bytes) and
    # node34 (View(-1)), so the boundary after node33 also carries node32's output.
    size_index = [layer.name for layer in layers].index("node33")
    assert layers[size_index].kind == "Size(0)"
    assert layers[size_index - 1].name == "node32"
    assert layers[size_index].cut_bytes == layers[size_index - 1].output_bytes + 4 == 12845056 + 4
    for index, layer in enumerate(layers[:-1]):
        if index != size_index:
            assert layer.cut_bytes == layer.output_bytes, layer.name
