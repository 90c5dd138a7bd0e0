"""The `planner` command: a thin typer layer over the Python API; user errors become one line.

Why one module of ~400 lines: one short function per command, each a thin layer over the Python API;
heavy imports stay inside the commands so that `planner --help` starts at once.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import typer

from planner.errors import PlannerError, ProfileError
from planner.files.cluster import CPU_LINKS, GPU_LINKS
from planner.files.export import TARGETS as EXPORT_TARGETS
from planner.files.plan import COST_MODELS

if TYPE_CHECKING:
    from rich.console import Console

    from planner.files.plan import Plan
    from planner.files.profile import Profile

# Each command imports what it needs inside its function: `planner --help` and the commands that
# only read and write files start without torch, pandas or matplotlib (tests/planner/test_cli_without_torch.py).

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Profile a PyTorch model and plan its pipeline-parallel training.",
)

T = TypeVar("T")

DEBUG_OPTION = typer.Option(False, "--debug", help="Show the full traceback of errors.")


def _run(debug: bool, action: Callable[[], T]) -> T:
    """Run `action`; a PlannerError becomes `error: ...` on stderr and exit code 1 (unless --debug), Ctrl-C
    (KeyboardInterrupt) its message (`planner train` says where it stopped) or `interrupted`, and exit code 130 (a
    job stopped by SIGTERM, `runtime.launch.JobStopped`: its own, 143)."""
    try:
        return action()
    except PlannerError as exc:
        if debug:
            raise
        typer.echo(f"error: {one_line(str(exc))}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt as exc:
        typer.echo(one_line(str(exc)) or "interrupted", err=True)
        raise typer.Exit(getattr(exc, "exit_code", 130)) from None


def one_line(message: str) -> str:
    """A possibly multi-line message (some torch errors span lines) joined into one line."""
    return " | ".join(line.strip() for line in message.splitlines() if line.strip())


def _console() -> Console:
    """stdout console; files and pipes get a wide one so tables are not wrapped."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def _stderr_progress(*columns: Any) -> Any:
    """A rich Progress on stderr after `columns` with the time elapsed, gone when done; none for a pipe or a file."""
    from rich.console import Console
    from rich.progress import Progress, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(*columns, TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


def _save_keeping_previous(result: Plan | Profile, path: Path, kind: str) -> Path:
    """`result.save(path)`, the file it replaces moved aside first (`keep_previous`: plans made from a profile, or
    reports of a plan's runs, still find theirs), with a note on stderr saying where."""
    from planner.files.fileformat import keep_previous
    from planner.files.plan import keep_previous_profile

    kept = keep_previous_profile(path) if kind == "profile" else keep_previous(path)
    saved = result.save(path)
    if kept is not None:
        typer.echo(f"note: {path} held a {kind} already; it is kept as {kept}", err=True)
    return saved


def _print_profile(profile: Profile, path: Path | None) -> None:
    from planner.display.tables import profile_table

    console = _console()
    console.print(profile_table(profile, console.width))
    if path is not None:
        console.print(f"wrote {path}")


@app.command()
def profile(
    model_file: str = typer.Argument(..., help="Python file defining build_model() and example_batch(batch_size)."),
    batch_size: str = typer.Option(
        "8", "--batch-size", "-b", help="Samples per mini-batch B. The layers are also timed at B/4, B/16, ... and 1 "
        "sample (everything else at B), as plans that cut a global batch into smaller microbatches interpolate "
        "between measured sizes; a comma list such as 1,2,4,8 names the sizes instead (the largest is B).",
    ),
    smaller_sizes: bool = typer.Option(
        True, "--smaller-sizes/--no-smaller-sizes", help="With one --batch-size, also time the layers at B/4, B/16, "
        "... and 1 sample (--no-smaller-sizes: at B only, plans then scale B's times to smaller microbatches).",
    ),
    device: str = typer.Option(
        "auto", help="auto (what `planner train` uses: the GPU where torch sees one, else the CPU), cpu, cuda, cuda:N.",
    ),
    dtype: str = typer.Option("float32", help="float32, bfloat16, float16 or float64 (planner train casts the "
                              "model the same way)."),
    warmup: int = typer.Option(3, help="Steps run before measuring."),
    iters: int = typer.Option(10, help="Measured steps; times are medians over them."),
    min_seconds: float = typer.Option(
        1.0, "--min-seconds", help="Measure more steps than --iters when they take less than this (seconds).",
    ),
    threads: Optional[int] = typer.Option(
        None, help="CPU threads (default on CPU: cores / 2, what `planner train` gives each of 2 processes)."
    ),
    processes: Optional[int] = typer.Option(
        None, help="CPU: processes computing at once while timing, this one and N-1 that train the model beside it, "
        "as N training processes on this machine will (default: 2 where the cores hold them; 1 on a GPU).",
    ),
    depth: Optional[int] = typer.Option(None, help="Take the modules this many calls below the model as layers."),
    split_points: Optional[str] = typer.Option(
        None, "--split-points", help="Comma-separated module names at which layers begin, e.g. h.4,h.8."
    ),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Profile file (default profiles/<model>.json)."),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Measure every layer of MODEL_FILE: times, cut bytes, parameter and activation memory."""

    def action() -> None:
        from rich.progress import BarColumn, TextColumn

        from planner.profiling.model_file import load_model_file
        from planner.profiling.profiler import ProfileSettings, parse_batch_sizes, profile_model, smaller_batch_sizes

        *other_sizes, largest = parse_batch_sizes(batch_size)
        if other_sizes and not smaller_sizes:
            raise ProfileError(f"--no-smaller-sizes applies to one --batch-size, and {batch_size!r} names the sizes to "
                               "measure: give one of them")
        if not other_sizes and smaller_sizes:
            other_sizes = list(smaller_batch_sizes(largest))
        settings = ProfileSettings(
            batch_size=largest, other_batch_sizes=tuple(other_sizes),
            device=device, dtype=dtype, warmup=warmup, iters=iters, min_seconds=min_seconds,
            threads=threads, processes=processes, depth=depth, split_points=tuple(p.strip() for p in (split_points or "").split(",") if p.strip()),
        )
        settings.check()  # option mistakes are reported before the model file is imported
        model_file_ = load_model_file(model_file)
        with _stderr_progress(TextColumn("{task.description}"), BarColumn(),
                              TextColumn("{task.completed}/{task.total}")) as progress:
            task = progress.add_task(f"profiling {model_file_.name}", total=None)

            def report(phase: str, done: int, total: int) -> None:
                progress.update(task, description=f"profiling {model_file_.name}: {phase}", completed=done, total=total)

            result = profile_model(model_file_, settings, report)
        path = _save_keeping_previous(result, out or Path("profiles") / f"{result.model_name}.json", "profile")
        _print_profile(result, path)

    _run(debug, action)


@app.command("import-pipedream")
def import_pipedream_command(
    graph: str = typer.Argument(..., help="A PipeDream profile (graph.txt)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help="Mini-batch size it was profiled at."),
    name: Optional[str] = typer.Option(None, help="Model name (default: the file name)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Profile file (default profiles/<name>.json)."),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Turn a PipeDream graph.txt profile into a planner profile."""

    def action() -> None:
        from planner.files.pipedream import import_pipedream

        if batch_size is not None and batch_size < 1:
            raise PlannerError(f"--batch-size must be at least 1, got {batch_size}")
        result = import_pipedream(graph, batch_size=batch_size, model_name=name)
        if batch_size is None:
            typer.echo("warning: no --batch-size given: planned throughput will count mini-batches, not samples",
                       err=True)
        path = _save_keeping_previous(result, out or Path("profiles") / f"{result.model_name}.json", "profile")
        _print_profile(result, path)

    _run(debug, action)


@app.command()
def inspect(
    profile_file: str = typer.Argument(..., help="A profile written by `planner profile` or `import-pipedream`."),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Print the layer table of a profile file."""
    from planner.files.profile import load_profile

    _run(debug, lambda: _print_profile(load_profile(profile_file), None))


def _listed(values: str | None) -> list[str] | None:
    """"a, b" -> ["a", "b"]; None for None or a text of no values."""
    listed = [value.strip() for value in (values or "").split(",") if value.strip()]
    return listed or None


@app.command("partition")
def partition_command(
    profile_file: str = typer.Argument(..., help="A profile written by `planner profile` or `import-pipedream`."),
    gpus: Optional[int] = typer.Option(None, "--gpus", "-g", help="Number of GPUs."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node (default: all in one)."),
    bandwidth: Optional[str] = typer.Option(
        None, help="Bandwidth within a node[,between nodes]: bytes/s or units such as GB/s, Gbit/s "
                   f"(default: {','.join(GPU_LINKS.bandwidths)} for a GPU profile, {','.join(CPU_LINKS.bandwidths)} "
                   "for a CPU one)."
    ),
    latency: Optional[str] = typer.Option(
        None, help="Latency per message within a node[,between nodes], e.g. 20us,200us (default: "
                   f"{','.join(GPU_LINKS.latencies)} for a GPU profile, {','.join(CPU_LINKS.latencies)} for a CPU one)."
    ),
    memory: Optional[str] = typer.Option(None, "--memory", help="Memory per GPU, e.g. 80GB (default: unconstrained; "
                                          "with --cluster, instead of the file's)."),
    optimizer: str = typer.Option("adam", "--optimizer", help="adam (2 state copies) or sgd (momentum, 1)."),
    cluster_file: Optional[str] = typer.Option(None, "--cluster", help="Cluster file (JSON or YAML) instead of the flags."),
    cost_model: str = typer.Option("planner", help=f"Objective: {', '.join(COST_MODELS)}."),
    schedule: str = typer.Option("auto", help="auto (the fastest of the synchronous ones below), gpipe, 1f1b, "
                                 "zb-h1 (zero bubble: backward split into input and weight gradients), interleaved-1f1b (2-4 chunks per "
                                 "GPU, round-robin), zbv (zero bubble, 2 chunks per GPU in a V), or pipedream "
                                 "(asynchronous: stale weights)."),
    microbatches: str = typer.Option("auto", help="Microbatches per iteration for gpipe/1f1b/zb-h1, or auto."),
    microbatch_size: Optional[int] = typer.Option(
        None, "--microbatch-size", help="Samples per microbatch (default: the profiled batch size)."
    ),
    global_batch_size: Optional[int] = typer.Option(
        None, "--global-batch-size", help="Samples per optimizer step that every plan trains (microbatch size x "
        "microbatches; default: what the microbatches imply)."
    ),
    no_recompute: bool = typer.Option(False, "--no-recompute", help="Never recompute activations."),
    straight: bool = typer.Option(False, "--straight", help="Forbid replicating stages."),
    compare: bool = typer.Option(False, "--compare", help="Also evaluate common splits under the same cost model, "
                                 "and the best plan of each other schedule."),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Plan file (default plans/<model>-<N>gpu[-straight].json)."
    ),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Choose stage boundaries and per-stage replication for PROFILE on a cluster; write the plan."""

    def action() -> None:
        from rich.progress import SpinnerColumn, TextColumn

        from planner.display.tables import comparison_table, plan_table
        from planner.files.cluster import assumed_links, default_links, load_cluster, make_cluster
        from planner.files.profile import load_profile
        from planner.planning.partition import compare_baselines, compare_schedules, partition

        flags = {"--gpus": gpus, "--gpus-per-node": gpus_per_node, "--bandwidth": bandwidth, "--latency": latency}
        given = [flag for flag, value in flags.items() if value is not None]
        if cluster_file is not None and given:
            raise PlannerError(f"--cluster {cluster_file} describes the whole cluster, so {', '.join(given)} would be "
                               "ignored: give either the cluster file or the flags (--gpus, --gpus-per-node, "
                               "--bandwidth, --latency; --memory goes with either)")
        if cluster_file is None and gpus is None:
            raise PlannerError("give --gpus N (or --cluster FILE)")
        count = microbatches.strip()
        if count != "auto" and not count.isdigit():
            raise PlannerError(f"--microbatches must be auto or a whole number, got {microbatches!r}")
        profile = load_profile(profile_file)
        links = default_links(profile.device)
        rates, delays = _listed(bandwidth), _listed(latency)  # None where not given (or given empty)
        if cluster_file is not None:
            cluster = load_cluster(cluster_file).with_memory(memory)  # --memory replaces the file's memory_bytes
        else:
            cluster = make_cluster(gpus, gpus_per_node, rates or links.bandwidths, memory, delays or links.latencies,
                                   links.allreduce if rates is None and delays is None else None)
        with _stderr_progress(SpinnerColumn(), TextColumn("{task.description}")) as progress:
            task = progress.add_task(f"planning {profile.model_name}", total=None)

            def report(step: str) -> None:
                progress.update(task, description=f"planning {profile.model_name}: {step}")

            plan = partition(profile, cluster, cost_model=cost_model, straight=straight, optimizer=optimizer,
                             profile_path=profile_file, schedule=schedule,
                             microbatches="auto" if count == "auto" else int(count),
                             microbatch_size=microbatch_size, recompute=not no_recompute,
                             global_batch_size=global_batch_size, progress=report)
        words = {"--cluster": cluster_file, "--gpus": gpus, "--gpus-per-node": gpus_per_node, "--bandwidth": bandwidth,
                 "--latency": latency, "--memory": memory, "--optimizer": optimizer if optimizer != "adam" else None,
                 "--cost-model": cost_model if cost_model != "planner" else None, "--schedule": schedule,
                 "--microbatches": count if count != "auto" else None, "--microbatch-size": microbatch_size,
                 "--global-batch-size": global_batch_size}
        plan = dataclasses.replace(plan, command=(
            "planner", "partition", profile_file, *(word for flag, value in words.items() if value is not None
                                                    for word in (flag, str(value))),
            *(["--no-recompute"] if no_recompute else []), *(["--straight"] if straight else [])))
        if cluster_file is None:
            assumed = assumed_links(cluster, rates is not None, delays is not None, links.kind)
            plan = plan.with_notes(assumed) if assumed else plan
        default_name = f"{profile.model_name}-{cluster.num_devices}gpu{'-straight' if straight else ''}.json"
        path = _save_keeping_previous(plan, out or Path("plans") / default_name, "plan")
        console = _console()
        console.print(plan_table(plan, console.width))
        if compare:
            others = compare_schedules(profile, plan, recompute=not no_recompute)
            console.print(comparison_table(plan, others + compare_baselines(profile, plan, optimizer)))
        console.print(f"wrote {path}")

    _run(debug, action)


PROFILE_OPTION = typer.Option(
    None, "--profile", "-p", help="The profile the plan was made from (default: the path the plan records)."
)


@app.command()
def show(
    plan_file: str = typer.Argument(..., help="A plan written by `planner partition`."),
    profile_file: Optional[str] = PROFILE_OPTION,
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Image file: .png, .svg or .pdf (default: next to the plan, <plan>.png)."
    ),
    scaling: bool = typer.Option(False, "--scaling", help="Also re-plan for 1, 2, 4, ... GPUs: <out>-scaling image."),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Draw a plan: layer times by stage, memory per GPU, the simulated schedule and memory over time."""

    def action() -> None:
        from planner.display.plots import plan_figure, save_figure, scaling_figure
        from planner.planning.scaling import scaling_table
        from planner.simulation.plan_simulation import simulate

        plan, profile = _plan_and_profile(plan_file, profile_file)
        path = out or Path(plan_file).with_suffix(".png")
        console = _console()
        console.print(f"wrote {save_figure(plan_figure(plan, profile, simulate(plan, profile)), path)} "
                      "(partition, schedule and memory panels)")
        if scaling:
            table = scaling_table(profile, plan.cluster, cost_model=plan.cost_model, straight=plan.straight,
                                  optimizer=plan.optimizer, microbatch_size=plan.microbatch_size)
            scaled = path.with_name(f"{path.stem}-scaling{path.suffix}")
            console.print(f"wrote {save_figure(scaling_figure(table), scaled)} (predicted throughput by GPU count)")

    _run(debug, action)


@app.command("simulate")
def simulate_command(
    plan_file: str = typer.Argument(..., help="A plan written by `planner partition`."),
    profile_file: Optional[str] = PROFILE_OPTION,
    iterations: int = typer.Option(1, "--iterations", "-n", help="Flushed iterations to simulate (gpipe, 1f1b, zb-h1)."),
    trace: Optional[Path] = typer.Option(
        None, "--trace", help="Write a Chrome trace-event file (open in ui.perfetto.dev or chrome://tracing)."
    ),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Play the plan's schedule op by op: iteration time, and idle share per rank; optionally a trace."""

    def action() -> None:
        from planner.display.tables import timeline_table
        from planner.simulation.plan_simulation import simulate

        if iterations < 1:
            raise PlannerError(f"--iterations must be at least 1, got {iterations}")
        plan, profile = _plan_and_profile(plan_file, profile_file)
        timeline = simulate(plan, profile, iterations)
        console = _console()
        console.print(timeline_table(plan, timeline))
        if trace is not None:
            console.print(f"wrote {timeline.write_trace(trace)} ({len(timeline.events)} ops)")

    _run(debug, action)


@app.command()
def compare(
    plan_file: str = typer.Argument(..., help="The plan the run used."),
    report_file: str = typer.Argument(..., help="The run's report (runtime.report.write_run_report)."),
    profile_file: Optional[str] = PROFILE_OPTION,
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Image file (.png, .svg, .pdf): the measured step under the simulated one."
    ),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Measured against predicted: iteration, throughput, and per stage compute, transfers, all-reduce, idle."""

    def action() -> None:
        from planner.display.plots import comparison_figure, save_figure
        from planner.files.plan import load_plan
        from planner.files.run_report import check_report_plan, load_run_report, run_report_table
        from planner.profiling.conditions import differences
        from planner.simulation.plan_simulation import simulate

        plan, report = load_plan(plan_file), load_run_report(report_file)
        check_report_plan(report, plan, plan_file)
        simulated = profile = None  # the simulation gives the predicted idle shares and the upper chart
        if out is not None or profile_file is not None or (plan.profile.path and Path(plan.profile.path).is_file()):
            plan, profile = _plan_and_profile(plan_file, profile_file)
            simulated = simulate(plan, profile)
        console = _console()
        console.print(run_report_table(report, simulated))
        if profile is not None:
            for line in differences(profile.settings.get("conditions", {}), report.meta.get("conditions", {})):
                console.print(f"warning: {line}")
        if simulated is None:
            console.print("predicted idle shares need the plan's profile: give --profile PATH")
        if out is not None and simulated is not None:
            figure = comparison_figure(simulated, report)
            console.print(f"wrote {save_figure(figure, out)} (simulated and measured schedules)")

    _run(debug, action)


@app.command()
def calibrate(
    profile_file: str = typer.Argument(..., help="The profile the plan was made from."),
    report_file: str = typer.Argument(..., help="The report of a run of the plan."),
    plan_file: str = typer.Option(..., "--plan", help="The plan the run used (its stages map to layers)."),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Calibrated profile (default: <profile>-calibrated.json next to PROFILE)."
    ),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Scale PROFILE's layer times by each stage's measured / predicted compute in REPORT; write a new profile."""

    def action() -> None:
        from planner.files.plan import load_plan
        from planner.files.profile import load_profile
        from planner.files.calibration import calibrate_profile, calibration_table
        from planner.files.run_report import load_run_report

        plan, report, profile = load_plan(plan_file), load_run_report(report_file), load_profile(profile_file)
        calibrated = calibrate_profile(profile, plan, report, plan_file, profile_file)
        source = Path(profile_file)
        path = _save_keeping_previous(calibrated, out or source.with_name(f"{source.stem}-calibrated{source.suffix or '.json'}"),
                                      "profile")
        console = _console()
        console.print(calibration_table(plan, report, calibrated.settings["calibrations"][-1]["ratios"]))
        console.print(f"wrote {path}; plan with it: planner partition {path}")

    _run(debug, action)


@app.command("export")
def export_command(
    plan_file: str = typer.Argument(..., help="A plan written by `planner partition` (gpipe, 1f1b or zb-h1)."),
    to: str = typer.Option(..., "--to", help="pippy (torch.distributed.pipelining) or deepspeed."),
    profile_file: Optional[str] = PROFILE_OPTION,
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="JSON file (default: <plan>.<target>.json next to the plan); the snippet "
                                  "(.py) or instructions (.txt) go next to it."
    ),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Write the plan's stages as settings for torch.distributed.pipelining or DeepSpeed, and how to use them."""

    def action() -> None:
        from planner.files.export import export_paths, export_plan, write_export
        from planner.files.plan import load_plan

        if to not in EXPORT_TARGETS:
            raise PlannerError(f"--to must be one of {', '.join(EXPORT_TARGETS)}, got {to!r}")
        json_path, text_path = export_paths(plan_file, to, out)
        if to == "deepspeed":  # the layer names per stage come from the profile
            plan, profile = _plan_and_profile(plan_file, profile_file)
        else:
            plan, profile = load_plan(plan_file), None
        exported = export_plan(plan, to, profile, plan_file)
        written = write_export(exported, json_path, text_path)
        typer.echo(exported.text().rstrip("\n"))  # (the file's own last newline would print as an empty line)
        typer.echo(f"wrote {written[0]} and {written[1]}")

    _run(debug, action)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    model_file: str = typer.Argument(..., help="Python file defining build_model() and example_batch(batch_size)."),
    plan_file: str = typer.Option(..., "--plan", help="A plan written by `planner partition`."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="Processes (default: the plan's rank count)."),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Train MODEL_FILE with PLAN on this machine: torchrun with one process per rank of the plan.

    Other options go to `python -m runtime.train` (see its --help): --steps, --lr, --optimizer,
    --data, --checkpoint-dir, --checkpoint-every, --resume, --timeout, --report, --log-every, ...
    """
    from runtime.launch import launch  # imports torch's launcher: only for this command

    _run(debug, lambda: launch([model_file, "--plan", plan_file, *ctx.args], nproc))


@app.command("cluster")
def cluster_command(
    out: Path = typer.Option(Path("clusters") / "this-machine.json", "--out", "-o", help="The cluster file to write."),
    nproc: int = typer.Option(2, "--nproc", help="Processes (one per GPU; CPU processes without GPUs)."),
    quick: bool = typer.Option(False, "--quick", help="Messages up to 4 MiB instead of 64 MiB."),
    debug: bool = DEBUG_OPTION,
) -> None:
    """Measure this machine's links (bandwidth and latency per message, all-reduce) and GPU memory
    under torchrun; write a cluster file for `planner partition --cluster`."""
    from runtime.launch import measure_cluster  # imports torch's launcher: only for this command

    _run(debug, lambda: measure_cluster(str(out), nproc, quick))


def _plan_and_profile(plan_file: str, profile_file: str | None) -> tuple[Plan, Profile]:
    """The plan and the profile it was made from (given, or the path the plan records)."""
    from planner.files.plan import load_plan
    from planner.files.profile import load_profile
    from planner.simulation.plan_simulation import resolve_profile

    plan = load_plan(plan_file)
    profile = None if profile_file is None else load_profile(profile_file)
    return plan, resolve_profile(plan, profile, plan_file, profile_file)


def main() -> None:
    """Console-script entry point. `planner profile` first re-executes itself with the glibc settings
    that `planner train` gives its workers (`profiling.conditions.steady_malloc`): glibc reads them
    only when a process starts, and CPU times measured under other ones differ by 5-10%."""
    arguments = sys.argv[1:]
    if arguments[:1] == ["profile"]:
        from planner.profiling.conditions import steady_malloc

        steady_malloc(["-m", "planner", *arguments])
    app(prog_name="planner")


if __name__ == "__main__":
    sys.exit(main())
