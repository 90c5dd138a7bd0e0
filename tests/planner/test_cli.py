"""Tests of the `planner` command line: one-line user errors, --debug, and a tiny end-to-end profile."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

from planner import load_profile
from planner import cli
from planner.cli import app
from planner.errors import ModelFileError
from planner.profiling.conditions import default_cpu_processes
from planner.files.plan import load_plan, profile_digest
from planner.files.profile import PROFILE_FORMAT, PROFILE_VERSION

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp.py"
FAST = ["--batch-size", "2", "--iters", "1", "--warmup", "0", "--processes", "1"]  # alone: no companion to start

TINY = """
import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4))


def example_batch(batch_size: int):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""

TWO_PARTS = """
import torch
from torch import nn


class TwoParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


def build_model() -> nn.Module:
    return TwoParts()


def example_batch(batch_size: int):
    return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))
"""

FORWARD_RAISES = """
import torch
from torch import nn


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("boom in forward")


def build_model() -> nn.Module:
    return Broken()


def example_batch(batch_size: int):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""

BACKWARD_RAISES = """
import torch
from torch import nn


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return Boom.apply(self.linear(x))


def build_model() -> nn.Module:
    return Broken()


def example_batch(batch_size: int):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)
"""

runner = CliRunner()


def write(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    """Write `source` (dedented) as `name` in tmp_path and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def invoke(*args: str | Path) -> Result:
    """Run the planner app in-process with the given arguments."""
    return runner.invoke(app, [str(arg) for arg in args])


def profile(tmp_path: Path, model: Path, *options: str) -> Result:
    """`planner profile MODEL --out <tmp>/out.json OPTIONS...` in-process."""
    return invoke("profile", model, "--out", tmp_path / "out.json", *options)


def assert_one_line_error(result: Result, *fragments: str) -> str:
    """Check exit 1, no traceback, nothing on stdout, exactly one `error:` line on stderr holding `fragments`."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    for text in (result.output, result.stdout, result.stderr):
        assert "Traceback" not in text
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: ")
    assert len(line) > len("error: ")
    assert result.stderr == line + "\n"
    for fragment in fragments:
        assert fragment in line
    return line


# planner profile: bad model files -------------------------------------------------------------


def test_profile_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.py"
    assert_one_line_error(profile(tmp_path, missing, *FAST), str(missing), "no such file")
    assert not (tmp_path / "out.json").exists()


def test_profile_not_python(tmp_path: Path) -> None:
    path = write(tmp_path, TINY, "model.txt")
    assert_one_line_error(profile(tmp_path, path, *FAST), str(path), "not a Python file")


def test_profile_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "import torch\n\n\ndef build_model(:\n    return 1\n")
    assert_one_line_error(profile(tmp_path, path, *FAST), str(path), "syntax error", "line 4")


def test_profile_module_raising_at_import(tmp_path: Path) -> None:
    path = write(tmp_path, "raise OSError('dataset directory is missing')\n")
    assert_one_line_error(profile(tmp_path, path, *FAST), str(path), "OSError", "dataset directory is missing")


def test_profile_build_model_missing(tmp_path: Path) -> None:
    path = write(tmp_path, TINY.replace("def build_model", "def make_model"))
    assert_one_line_error(profile(tmp_path, path, *FAST), str(path), "build_model()", "missing")


def test_profile_example_batch_missing(tmp_path: Path) -> None:
    path = write(tmp_path, TINY.replace("def example_batch", "def sample_batch"))
    assert_one_line_error(profile(tmp_path, path, *FAST), str(path), "example_batch()", "missing")


def test_profile_build_model_returns_an_int(tmp_path: Path) -> None:
    path = write(tmp_path, TINY.replace("return nn.Sequential(nn.Linear(4, 4))", "return 7"))
    assert_one_line_error(
        profile(tmp_path, path, *FAST), str(path), "build_model() returned int", "torch.nn.Module"
    )


def test_profile_example_batch_returns_a_tensor(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        TINY.replace("return torch.randn(batch_size, 4), torch.randn(batch_size, 4)", "return torch.randn(batch_size, 4)"),
    )
    assert_one_line_error(
        profile(tmp_path, path, *FAST), str(path), "example_batch(2) returned", "expected a pair"
    )


def test_profile_model_raising_in_forward(tmp_path: Path) -> None:
    path = write(tmp_path, FORWARD_RAISES)
    assert_one_line_error(
        profile(tmp_path, path, *FAST), str(path), "ValueError", "in forward", "boom in forward"
    )


def test_profile_model_raising_in_backward(tmp_path: Path) -> None:
    path = write(tmp_path, BACKWARD_RAISES)
    assert_one_line_error(
        profile(tmp_path, path, *FAST), str(path), "RuntimeError", "in backward", "boom in backward"
    )


# planner profile: bad option values -----------------------------------------------------------


def test_profile_batch_size_zero(tmp_path: Path) -> None:
    path = write(tmp_path, TINY)
    assert_one_line_error(profile(tmp_path, path, "--batch-size", "0"), "--batch-size", "got 0")


@pytest.mark.parametrize(("sizes", "fragments"), [
    ("0,2", ["--batch-size must be at least 1", "got 0 in '0,2'"]),
    ("2,-4", ["--batch-size must be at least 1", "got -4"]),
    ("2,2", ["--batch-size lists 2 twice"]),
    ("1,two", ["--batch-size takes whole numbers", "got 'two'"]),
    ("1,,4", ["--batch-size takes whole numbers", "got ''"]),
])
def test_profile_bad_batch_size_lists(tmp_path: Path, sizes: str, fragments: list[str]) -> None:
    path = write(tmp_path, TINY)
    assert_one_line_error(profile(tmp_path, path, "--batch-size", sizes), *fragments)
    assert not (tmp_path / "out.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU, so --device cuda is valid")
def test_profile_cuda_without_gpu(tmp_path: Path) -> None:
    path = write(tmp_path, TINY)
    assert_one_line_error(
        profile(tmp_path, path, *FAST, "--device", "cuda"), "'cuda'", "CUDA is not available"
    )


def test_profile_nonsense_device(tmp_path: Path) -> None:
    path = write(tmp_path, TINY)
    assert_one_line_error(
        profile(tmp_path, path, *FAST, "--device", "nonsense"), "'nonsense'", "not a device name"
    )


def test_profile_unknown_split_point_on_mlp(tmp_path: Path) -> None:
    result = profile(tmp_path, MLP, *FAST, "--split-points", "no.such.module")
    assert_one_line_error(result, "'no.such.module'", "split point")
    assert not (tmp_path / "out.json").exists()


def test_profile_error_raised_while_profiling_is_the_only_stderr_output(tmp_path: Path) -> None:
    path = write(tmp_path, TINY)
    result = profile(tmp_path, path, *FAST, "--device", "nonsense")
    assert result.stderr == "error: device 'nonsense': not a device name; use auto, cpu, cuda or cuda:N\n"


@pytest.mark.parametrize(
    ("split_points", "layers"),
    [("head", ["encoder", "head"]), ("encoder,head", ["encoder", "head"]), ("encoder", ["encoder"])],
)
def test_profile_split_points_by_name_on_a_custom_model(
    tmp_path: Path, split_points: str, layers: list[str]
) -> None:
    path = write(tmp_path, TWO_PARTS, "two_parts.py")
    result = profile(tmp_path, path, *FAST, "--split-points", split_points)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    saved = load_profile(tmp_path / "out.json")
    assert [layer.name for layer in saved.layers] == layers
    assert saved.settings["split_points"] == split_points.split(",")
    assert sum(layer.param_bytes for layer in saved.layers) == (4 * 6 + 6 + 6 * 3 + 3) * 4


# --debug --------------------------------------------------------------------------------------


def test_debug_raises_the_model_file_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.py"
    result = profile(tmp_path, missing, *FAST, "--debug")
    assert result.exit_code == 1
    assert isinstance(result.exception, ModelFileError)
    assert result.exception.path == str(missing)
    assert "error:" not in result.stderr


def test_debug_keeps_the_model_exception_as_cause(tmp_path: Path) -> None:
    path = write(tmp_path, FORWARD_RAISES)
    result = profile(tmp_path, path, *FAST, "--debug")
    assert isinstance(result.exception, ModelFileError)
    assert isinstance(result.exception.__cause__, ValueError)
    assert "boom in forward" in str(result.exception)


# Ctrl-C ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("message, line", [
    ("", "interrupted"),  # any command
    ("interrupted: training stopped after step 45; the last complete checkpoint is ckpt/step-00000040: continue "
     "with --resume", None),  # `planner train` says where it stopped the job
])
def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch: pytest.MonkeyPatch, message: str,
                                              line: str | None) -> None:
    import runtime.launch

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt(message)

    monkeypatch.setattr(runtime.launch, "launch", interrupted)
    result = invoke("train", MLP, "--plan", "plan.json", "--debug")
    assert result.exit_code == 130 and result.stdout == ""
    assert result.stderr == f"{line or message}\n"


# planner export -----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["pippy", "deepspeed"])
def test_export_prints_the_file_then_what_it_wrote_without_an_empty_line(tmp_path: Path, target: str) -> None:
    # (a 1-stage data-parallel plan's pippy export showed an empty line before "wrote": every export did)
    from planner.files.cluster import make_cluster
    from planner.planning.partition import partition

    profile = REPO / "profiles" / "mlp.json"
    plan = partition(load_profile(profile), make_cluster(2), profile_path=str(profile))
    assert [stage.replicas for stage in plan.stages] == [2]
    result = invoke("export", plan.save(tmp_path / "dp.json"), "--to", target)
    assert result.exit_code == 0, result.output
    json_path = tmp_path / f"dp.{target}.json"
    text_path = json_path.with_suffix(".py" if target == "pippy" else ".txt")
    text = text_path.read_text()
    assert text.endswith("\n") and not text.endswith("\n\n")  # the file ends as a file does
    assert result.stdout == f"{text}wrote {json_path} and {text_path}\n"


# planner inspect / import-pipedream -----------------------------------------------------------


def test_inspect_other_format(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "pipeline-planner/plan", "version": 1}), encoding="utf-8")
    assert_one_line_error(invoke("inspect", path), str(path), "'pipeline-planner/plan'", PROFILE_FORMAT)


def test_inspect_newer_version(tmp_path: Path) -> None:
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 999}), encoding="utf-8")
    assert_one_line_error(
        invoke("inspect", path), str(path), "version 999", f"1..{PROFILE_VERSION}", "upgrade the planner"
    )


def test_inspect_not_json(tmp_path: Path) -> None:
    path = tmp_path / "notes.json"
    path.write_text("layer 0 took 3 ms\n", encoding="utf-8")
    assert_one_line_error(invoke("inspect", path), str(path), "not valid JSON", "line 1")


def test_inspect_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "gone.json"
    assert_one_line_error(invoke("inspect", path), str(path), "no such file")


def test_import_pipedream_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "graph.txt"
    result = invoke("import-pipedream", path, "--out", tmp_path / "out.json")
    assert_one_line_error(result, str(path), "no such file")
    assert not (tmp_path / "out.json").exists()


def test_import_pipedream_batch_size_zero(tmp_path: Path) -> None:
    result = invoke("import-pipedream", tmp_path / "graph.txt", "--batch-size", "0")
    assert_one_line_error(result, "--batch-size", "got 0")


# happy path -----------------------------------------------------------------------------------


def test_profile_mlp_then_inspect(tmp_path: Path) -> None:
    out = tmp_path / "mlp.json"
    result = invoke("profile", MLP, "--iters", "2", "--warmup", "0", "--out", out)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert "error:" not in result.output
    table_layers = re.findall(r"^\s*(\d+)\s+(\S+)\s+(?:Linear|ReLU)\s", result.stdout, flags=re.MULTILINE)
    assert [name for _index, name in table_layers] == [str(i) for i in range(13)]
    assert [int(index) for index, _name in table_layers] == list(range(13))
    assert f"wrote {out}" in result.stdout

    saved = load_profile(out)
    assert saved.model_name == "mlp"
    assert saved.batch_size == 8
    assert saved.batch_sizes == (1, 2, 8)  # the layers timed at smaller microbatches too, for plans that cut the batch
    assert [layer.name for layer in saved.layers] == [str(i) for i in range(13)]
    assert saved.settings["iters"] == 2 and saved.settings["warmup"] == 0
    # measured as training runs by default: among as many processes as `planner train` starts (companions)
    assert saved.settings["conditions"]["processes"] == default_cpu_processes(saved.threads)

    inspected = invoke("inspect", out)
    assert inspected.exit_code == 0, inspected.output
    assert inspected.stderr == ""
    inspected_layers = re.findall(r"^\s*\d+\s+(\S+)\s+(?:Linear|ReLU)\s", inspected.stdout, flags=re.MULTILINE)
    assert inspected_layers == [str(i) for i in range(13)]
    assert "crowded" not in result.stdout + inspected.stdout  # the defaults fit the cores


@pytest.mark.parametrize(("options", "sizes"), [((), (1, 4)), (("--no-smaller-sizes",), (4,)),
                                               (("--batch-size", "3,4", "--smaller-sizes"), (3, 4))],
                         ids=["default", "no-smaller", "a-list"])
def test_one_batch_size_is_timed_at_smaller_sizes_unless_asked_not_to(tmp_path: Path, options: tuple[str, ...],
                                                                      sizes: tuple[int, ...]) -> None:
    result = profile(tmp_path, MLP, *FAST, "--batch-size", "4", "--min-seconds", "0", *options)
    assert result.exit_code == 0, result.output
    assert load_profile(tmp_path / "out.json").batch_sizes == sizes


def test_no_smaller_sizes_with_a_list_of_sizes_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(profile(tmp_path, MLP, *FAST, "--batch-size", "2,4", "--no-smaller-sizes"),
                          "--no-smaller-sizes applies to one --batch-size, and '2,4' names the sizes to measure: "
                          "give one of them")


def test_a_profile_measured_on_more_threads_than_cores_says_so(tmp_path: Path) -> None:
    # `planner profile --processes 4 --threads 2` on the 2-core machine read a step 20 times the mlp's, and its
    # timing hooks x0.34, with nothing said
    document = json.loads((REPO / "profiles" / "mlp.json").read_text())
    document["settings"]["conditions"].update(processes=4, threads=2, cores=2)
    path = tmp_path / "crowded.json"
    path.write_text(json.dumps(document))
    inspected = invoke("inspect", path)
    assert inspected.exit_code == 0, inspected.output
    text = " ".join(inspected.stdout.split())  # the table's caption wraps
    assert "note: measured while 4 processes x 2 threads share 2 cores (each thread gets 0.25 of a core)" in text
    assert "--processes x --threads at most the cores" in text


def test_a_profile_measured_beside_other_processes_says_so(tmp_path: Path) -> None:
    # a profile taken while two pytest workers ran beside it predicted 1.28-1.35x the compute training measured on
    # the quiet machine, with nothing said
    document = json.loads((REPO / "profiles" / "mlp.json").read_text())
    document["settings"]["conditions"].update(processes=2, threads=1, cores=2, own_busy_cores=0.8,
                                              others_busy_cores=1.2)
    path = tmp_path / "loaded.json"
    path.write_text(json.dumps(document))
    inspected = invoke("inspect", path)
    assert inspected.exit_code == 0, inspected.output
    text = " ".join(inspected.stdout.split())  # the table's caption wraps
    assert ("warning: the profile was measured while other processes used 1.2 of its machine's 2 cores (its own 2 "
            "threads got 0.8): its layers may read up to 2.5x slower") in text
    assert "profile again with the machine quiet" in text


def test_profile_at_several_batch_sizes_writes_their_times(tmp_path: Path) -> None:
    path = write(tmp_path, TWO_PARTS, "two_parts.py")
    result = profile(tmp_path, path, "--batch-size", "2, 1", "--iters", "1", "--warmup", "0", "--min-seconds", "0",
                     "--processes", "1")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["version"] == PROFILE_VERSION == 3 and document["batch_size"] == 2
    assert [sized["batch_size"] for sized in document["size_times"]] == [1]
    saved = load_profile(tmp_path / "out.json")
    assert saved.batch_sizes == (1, 2) and len(saved.size_times[0].fwd_ms) == saved.num_layers == 2


# the real process -----------------------------------------------------------------------------


def test_real_process_prints_one_line_and_exits_1(tmp_path: Path) -> None:
    missing = tmp_path / "missing_model.py"
    completed = subprocess.run(
        [sys.executable, "-m", "planner", "profile", str(missing)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert completed.returncode == 1
    assert completed.stdout == ""
    assert "Traceback" not in completed.stderr
    lines = completed.stderr.splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("error: ")
    assert str(missing) in lines[0]
    assert completed.stderr == lines[0] + "\n"


def test_profile_multi_line_model_error_is_joined_into_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, FORWARD_RAISES.replace('"boom in forward"', '"first line\\nsecond line"'))
    line = assert_one_line_error(profile(tmp_path, path, *FAST), str(path), "first line | second line")
    assert "fix the model" in line


def test_profile_model_file_calling_sys_exit_is_reported_not_obeyed(tmp_path: Path) -> None:
    path = write(tmp_path, "import sys\nsys.exit(3)\n")
    assert_one_line_error(profile(tmp_path, path, *FAST), str(path), "SystemExit", "while importing")


def test_profile_source_with_a_null_byte_is_a_syntax_error_without_line_none(tmp_path: Path) -> None:
    path = tmp_path / "nul.py"
    path.write_bytes(b"x = 1\x00\n")
    line = assert_one_line_error(profile(tmp_path, path, *FAST), str(path), "syntax error")
    assert "None" not in line


def test_import_pipedream_writes_a_profile_and_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "skip.json"
    result = invoke("import-pipedream", REPO / "tests" / "data" / "pipedream_skip.txt", "--batch-size", "32",
                    "--out", out)
    assert result.exit_code == 0, result.output
    imported = load_profile(out)
    assert imported.batch_size == 32 and imported.model_name == "pipedream_skip"
    assert all(layer.name in result.stdout for layer in imported.layers)


def test_profile_out_pointing_at_a_directory_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, TINY)
    result = invoke("profile", path, *FAST, "--out", tmp_path)
    assert_one_line_error(result, str(tmp_path), "is a directory")


# planner show and planner simulate ------------------------------------------------------------

EXAMPLE_PROFILES = sorted((REPO / "profiles").glob("*.json"))


def make_plan(tmp_path: Path, profile_path: Path, *options: str) -> Path:
    """`planner partition PROFILE --gpus 4 --gpus-per-node 2 OPTIONS --out <tmp>/<name>.json`; its path."""
    out = tmp_path / f"{profile_path.stem}-plan.json"
    result = invoke("partition", profile_path, "--gpus", "4", "--gpus-per-node", "2",
                    "--bandwidth", "50GB/s,5GB/s", *options, "--out", out)
    assert result.exit_code == 0, result.output
    assert "planning" not in result.output  # the status line is for a terminal: a pipe or a file gets none
    return out


def assert_real_image(path: Path) -> None:
    """A PNG of plausible size with more than one colour in it."""
    import matplotlib.image

    assert path.stat().st_size > 10_000
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 500 and pixels.shape[1] > 500
    assert pixels[..., :3].std() > 0.05


@pytest.mark.parametrize("profile_path", EXAMPLE_PROFILES, ids=lambda path: path.stem)
def test_show_and_simulate_every_example(profile_path: Path, tmp_path: Path) -> None:
    from planner.files.plan import load_plan
    from planner.simulation.plan_simulation import simulate

    plan_path = make_plan(tmp_path, profile_path)
    shown = invoke("show", plan_path)
    assert shown.exit_code == 0, shown.output
    assert_real_image(plan_path.with_suffix(".png"))  # next to the plan by default

    trace_path = tmp_path / "trace.json"
    simulated = invoke("simulate", plan_path, "--trace", trace_path)
    assert simulated.exit_code == 0, simulated.output
    plan = load_plan(plan_path)
    timeline = simulate(plan, load_profile(profile_path))
    ops = [event for event in json.loads(trace_path.read_text())["traceEvents"] if event["ph"] == "X"]
    assert len(ops) == len(timeline.events)  # one trace event per simulated op
    assert {(event["pid"], event["name"]) for event in ops} == {
        (row.rank, row.op if row.microbatch < 0 else f"{row.op} {row.microbatch}")
        for row in timeline.events.itertuples()
    }
    ranks = [rank for stage in plan.stages for rank in stage.ranks]
    for rank in ranks:  # one table row per rank
        assert re.search(rf"^\s*{rank}\s+\d+\s+\d+\s", simulated.stdout, re.MULTILINE), simulated.stdout
    assert f"the plan states {plan.predicted.iteration_ms:.4g} ms" in " ".join(simulated.stdout.split())


def test_simulate_more_iterations_simulates_more_ops(tmp_path: Path) -> None:
    plan_path = make_plan(tmp_path, REPO / "profiles" / "gpt.json", "--schedule", "1f1b", "--microbatches", "4")
    counts = []
    for iterations in ("1", "3"):
        trace_path = tmp_path / f"trace{iterations}.json"
        result = invoke("simulate", plan_path, "--iterations", iterations, "--trace", trace_path)
        assert result.exit_code == 0, result.output
        counts.append(sum(event["ph"] == "X" for event in json.loads(trace_path.read_text())["traceEvents"]))
    assert counts[1] == 3 * counts[0]


@pytest.mark.parametrize("suffix,magic", [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_show_writes_vector_formats(tmp_path: Path, suffix: str, magic: bytes) -> None:
    plan_path = make_plan(tmp_path, REPO / "profiles" / "mlp.json")
    out = tmp_path / f"picture{suffix}"
    result = invoke("show", plan_path, "--out", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(magic) and out.stat().st_size > 10_000


def test_show_scaling_writes_a_second_image(tmp_path: Path) -> None:
    plan_path = make_plan(tmp_path, REPO / "profiles" / "mlp.json", "--schedule", "1f1b", "--microbatches", "4")
    result = invoke("show", plan_path, "--out", tmp_path / "mlp.png", "--scaling")
    assert result.exit_code == 0, result.output
    assert_real_image(tmp_path / "mlp-scaling.png")


def test_show_refuses_an_unknown_image_type_and_keeps_the_old_file(tmp_path: Path) -> None:
    plan_path = make_plan(tmp_path, REPO / "profiles" / "mlp.json")
    old = tmp_path / "plan.jpg"
    old.write_bytes(b"keep me")
    assert_one_line_error(invoke("show", plan_path, "--out", old), "plan.jpg", ".png")
    assert old.read_bytes() == b"keep me"


def test_show_without_the_recorded_profile_asks_for_it(tmp_path: Path) -> None:
    copy = tmp_path / "profile-copy.json"
    copy.write_bytes((REPO / "profiles" / "mlp.json").read_bytes())
    plan_path = make_plan(tmp_path, copy)
    copy.unlink()
    assert_one_line_error(invoke("show", plan_path), str(copy), "--profile")
    result = invoke("show", plan_path, "--profile", REPO / "profiles" / "mlp.json")
    assert result.exit_code == 0, result.output


def test_simulate_with_another_profile_names_both_files(tmp_path: Path) -> None:
    plan_path = make_plan(tmp_path, REPO / "profiles" / "mlp.json")
    other = REPO / "profiles" / "gpt.json"
    assert_one_line_error(invoke("simulate", plan_path, "--profile", other), str(plan_path), str(other), "digest")


def test_simulate_zero_iterations(tmp_path: Path) -> None:
    plan_path = make_plan(tmp_path, REPO / "profiles" / "mlp.json")
    assert_one_line_error(invoke("simulate", plan_path, "--iterations", "0"), "--iterations")


def test_simulate_missing_plan(tmp_path: Path) -> None:
    assert_one_line_error(invoke("simulate", tmp_path / "nope.json"), "nope.json")


def test_show_a_profile_given_as_the_plan(tmp_path: Path) -> None:
    assert_one_line_error(invoke("show", REPO / "profiles" / "mlp.json"), "mlp.json", "pipeline-planner/profile")


def test_simulate_a_plan_with_an_unknown_schedule(tmp_path: Path) -> None:
    plan_path = make_plan(tmp_path, REPO / "profiles" / "mlp.json", "--schedule", "1f1b")
    body = json.loads(plan_path.read_text())
    body["schedule"] = "zigzag"
    plan_path.write_text(json.dumps(body))
    assert_one_line_error(invoke("simulate", plan_path), str(plan_path), "zigzag", "1f1b")


def test_partition_unknown_schedule(tmp_path: Path) -> None:
    assert_one_line_error(invoke("partition", REPO / "profiles" / "mlp.json", "--gpus", "2", "--schedule", "zigzag",
                                 "--out", tmp_path / "p.json"), "zigzag", "gpipe")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("flags", [["--gpus", "4"], ["--bandwidth", "10GB/s"], ["--gpus-per-node", "2", "--memory", "8GB"]])
def test_partition_refuses_flags_a_cluster_file_would_override(tmp_path: Path, flags: list[str]) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("levels:\n  - {name: node, size: 2, bandwidth: 300GB/s}\n")
    named = [flag for flag in flags if flag.startswith("--") and flag != "--memory"]  # --memory goes with a file
    assert_one_line_error(invoke("partition", REPO / "profiles" / "mlp.json", "--cluster", cluster, *flags,
                                 "--out", tmp_path / "p.json"), str(cluster), ", ".join(named), "would be ignored")
    assert not (tmp_path / "p.json").exists()
    assert invoke("partition", REPO / "profiles" / "mlp.json", "--cluster", cluster,
                  "--out", tmp_path / "p.json").exit_code == 0



def test_memory_limits_a_cluster_file_without_device_memory(tmp_path: Path) -> None:
    """A measured CPU cluster has no device memory (`planner cluster` writes memory_bytes: null); --memory
    gives it one, and replaces the file's where it has one."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"levels": [{"name": "node", "size": 2, "bandwidth": "2.5GB/s"}],
                                   "memory_bytes": None}))
    unlimited = invoke("partition", REPO / "profiles" / "mlp.json", "--cluster", cluster, "--out", tmp_path / "u.json")
    assert unlimited.exit_code == 0, unlimited.output
    assert load_plan(tmp_path / "u.json").cluster.memory_bytes is None
    limited = invoke("partition", REPO / "profiles" / "mlp.json", "--cluster", cluster, "--memory", "120MB",
                     "--out", tmp_path / "m.json")
    assert limited.exit_code == 0, limited.output
    plan = load_plan(tmp_path / "m.json")
    assert plan.cluster.memory_bytes == 120_000_000 and plan.cluster.num_devices == 2
    assert plan.predicted.peak_memory_bytes <= 120_000_000 and all(stage.memory_bytes <= 120_000_000
                                                                   for stage in plan.stages)


def test_outputs_written_again_keep_what_they_replace(tmp_path: Path) -> None:
    """A profile, plan or calibrated profile written over another is moved aside first (nothing a user had is
    lost): under its digest, which a plan of the old profile names when it no longer matches."""
    profile = tmp_path / "mlp.json"
    shutil.copy(REPO / "profiles" / "mlp.json", profile)
    plan = make_plan(tmp_path, profile, "--schedule", "1f1b")
    first = plan.read_text()
    again = invoke("partition", profile, "--gpus", "2", "--schedule", "gpipe", "--out", plan)
    assert again.exit_code == 0, again.output
    kept = list(tmp_path.glob(f"{plan.stem}.*.json"))
    assert len(kept) == 1 and kept[0].read_text() == first, kept
    assert f"{plan} held a plan already; it is kept as {kept[0]}" in again.stderr
    # the profile measured again (here: its batch size edited), then the first plan shown with the new profile
    old_profile = profile.read_text()
    body = json.loads(old_profile)
    body["batch_size"] += 1
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(body))
    cli._save_keeping_previous(load_profile(edited), profile, "profile")  # as `planner profile --out` saves
    digest = profile_digest(load_profile(REPO / "profiles" / "mlp.json"))
    kept_profile = tmp_path / f"mlp.{digest[:12]}.json"
    assert kept_profile.read_text() == old_profile
    assert_one_line_error(invoke("show", kept[0], "--profile", profile, "--out", tmp_path / "plan.png"),
                          str(kept_profile), "give that one")


def test_partition_assumes_the_links_of_the_profiles_device_and_says_so(tmp_path: Path) -> None:
    """Without a cluster file or link flags, a CPU profile is planned on the links of gloo processes (2.5 GB/s and
    130 us a message, all-reduces at 1.4 GB/s and 180 us within a machine; 1 GB/s and 200 us between machines), a
    GPU profile on 300 and 25 GB/s without latency: a GPU's links put a CPU pipeline's transfers at 1/261 of what
    training measured. The notes name the defaults and their kind; a given bandwidth keeps the link's all-reduce.
    Before, every profile got the GPU's links."""
    def planned(profile_path: Path, *flags: str) -> tuple[list[dict], str]:
        out = tmp_path / "plan.json"
        result = invoke("partition", profile_path, *flags, "--out", out)
        assert result.exit_code == 0, result.output
        body = json.loads(out.read_text())
        return body["cluster"]["levels"], " ".join(body["notes"])

    levels, notes = planned(REPO / "profiles" / "mlp.json", "--gpus", "4", "--gpus-per-node", "2")
    assert [(lv["bandwidth_Bps"], lv["latency_s"]) for lv in levels] == [(2.5e9, pytest.approx(130e-6)),
                                                                         (1e9, pytest.approx(200e-6))]
    assert (levels[0]["allreduce_bandwidth_Bps"], levels[0]["allreduce_latency_s"]) == (1.4e9, pytest.approx(180e-6))
    assert "allreduce_bandwidth_Bps" not in levels[1]
    assert ("assumed bandwidth 2.5 GB/s, 1 GB/s and latency 130 us, 200 us per level, and all-reduces at 1.4 GB/s + "
            "180 us a ring step within a node (defaults for CPU processes, not measured)") in notes

    assert planned(REPO / "profiles" / "mlp.json", "--gpus", "4", "--gpus-per-node", "2", "--latency", " ") == (
        levels, notes)  # a flag of no values is no flag

    levels, notes = planned(REPO / "profiles" / "mlp.json", "--gpus", "2", "--bandwidth", "10GB/s")
    assert levels == [{"name": "node", "size": 2, "bandwidth_Bps": 10e9, "latency_s": pytest.approx(130e-6)}]
    assert "assumed latency 130 us per level (defaults for CPU processes" in notes and "bandwidth 10" not in notes
    assert "all-reduces at" not in notes

    levels, notes = planned(REPO / "tests" / "data" / "profiles-h200" / "gpt2-medium.json", "--gpus", "2")
    assert levels == [{"name": "node", "size": 2, "bandwidth_Bps": 300e9, "latency_s": 0.0}]
    assert "bandwidth 300 GB/s and latency 0 us per level (defaults for GPUs" in notes


def test_partition_of_a_model_file_says_to_profile_it_first(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text("def build_model(): ...\n")
    assert_one_line_error(invoke("partition", model, "--gpus", "2"), str(model), "a Python file",
                          f"`planner profile {model}`")


def test_partition_and_simulate_print_one_idle_figure_and_every_all_reduce(tmp_path: Path) -> None:
    """(The user's path printed 22.1% idle from partition and 20.1% from simulate; the all-reduce column read 0 for
    GPT-2's tied embedding.) The two commands print the same idle share for one plan, and partition's table counts the
    tied weights' all-reduce with a footnote."""
    out = tmp_path / "plan.json"
    made = invoke("partition", REPO / "profiles" / "gpt.json", "--gpus", "2", "--straight", "--schedule", "1f1b",
                  "--microbatches", "4", "-o", out)
    assert made.exit_code == 0, made.output
    simulated = invoke("simulate", out)
    assert simulated.exit_code == 0, simulated.output
    figures = [re.findall(r"idle (\d+\.\d%) of device time", " ".join(result.stdout.split()))
               for result in (made, simulated)]
    assert len(figures[0]) == len(figures[1]) == 1 and figures[0] == figures[1], (made.stdout, simulated.stdout)
    assert figures[0][0] == f"{load_plan(out).predicted.bubble_fraction:.1%}"
    assert "GPUs idle" not in made.stdout and "mean bubble" not in simulated.stdout
    assert "* all-reduce ms includes summing tied weights' gradients" in made.stdout
    assert re.search(r"\s\d+\.\d+\*\s", made.stdout), made.stdout


def test_partition_says_which_option_fixes_a_global_batch_it_chose(tmp_path: Path) -> None:
    """Without --global-batch-size (and --microbatches) the global batch is the search's; the output says so."""
    chosen = invoke("partition", REPO / "profiles" / "gpt.json", "--gpus", "2", "-o", tmp_path / "a.json")
    assert chosen.exit_code == 0, chosen.output
    plan = load_plan(tmp_path / "a.json")
    text = " ".join(chosen.stdout.split())
    assert f"global batch {plan.global_batch_size}" in text and "--global-batch-size fixes it" in text
    fixed = invoke("partition", REPO / "profiles" / "gpt.json", "--gpus", "2", "--global-batch-size", "32",
                   "-o", tmp_path / "b.json")
    assert fixed.exit_code == 0, fixed.output
    assert "global batch 32" in fixed.stdout and "--global-batch-size fixes it" not in " ".join(fixed.stdout.split())


def test_a_mistyped_train_option_is_one_line_naming_the_closest(tmp_path: Path) -> None:
    """(`planner train gpt2.py --plan plan.json --stepz 3` printed argparse's usage as `python -m runtime.train`.)
    The options are read before the plan or the model file."""
    line = assert_one_line_error(invoke("train", MLP, "--plan", tmp_path / "plan.json", "--stepz", "3"),
                                 "planner train: unknown option --stepz; did you mean --steps?")
    assert "runtime.train" not in line and "usage" not in line
