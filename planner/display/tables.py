"""Readable tables of profiles, plans and simulations for the terminal (rich)."""

from __future__ import annotations

from typing import Sequence

from rich import box
from rich.table import Table

from planner.planning.partition import BaselineResult
from planner.profiling.conditions import oversubscribed, profile_load_warning
from planner.files.plan import Plan, StagePlan
from planner.files.profile import LayerProfile, Profile
from planner.schedules.schedule import BACKWARD, FORWARD, WEIGHT
from planner.files.timeline import Timeline
from planner.units import format_bytes, format_ms, name_range, plural, significant

_COMPACT = {"box": box.SIMPLE_HEAD, "pad_edge": False}  # no vertical rules: fits 80 columns


NARROW_COLUMNS = 110  # below this terminal width, tables leave out their least useful column


def profile_table(profile: Profile, width: int | None = None) -> Table:
    """One row per layer: times in ms per mini-batch, sizes in binary units (no `kind` when narrow);
    where measured, "in-grad": the share of `bwd ms` that computes the layer's input gradients."""
    with_kind = width is None or width >= NARROW_COLUMNS
    with_input = any(layer.bwd_input_ms is not None for layer in profile.layers)
    batch = "?" if profile.batch_size is None else str(profile.batch_size)
    table = Table(
        title=f"{profile.model_name}: {profile.num_layers} layers on {profile.device_name} "
        f"({profile.device}, {profile.dtype}, batch {batch})",
        caption=profile_summary(profile), caption_justify="left", **_COMPACT,
    )
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("layer", overflow="fold", min_width=8)  # long names wrap, never lose their end
    if with_kind:
        table.add_column("kind", no_wrap=True, overflow="ellipsis", max_width=14)
    for header in ("fwd ms", "bwd ms", *(["in-grad"] if with_input else []), "output", "cut", "params", "saved"):
        table.add_column(header, justify="right", no_wrap=True)
    shared_layers = {index for shared in profile.shared_params for index in shared.layers}
    for index, layer in enumerate(profile.layers):
        params = format_bytes(layer.param_bytes) + (" *" if index in shared_layers else "")
        kind = layer.kind
        cells = [str(index), layer.name] + ([kind] if with_kind else []) + [
            format_ms(layer.fwd_ms), format_ms(layer.bwd_ms), *([input_share(layer)] if with_input else []),
            format_bytes(layer.output_bytes),
            format_bytes(layer.cut_bytes), params, format_bytes(layer.saved_bytes),
        ]
        table.add_row(*cells)
    return table


def input_share(layer: LayerProfile) -> str:
    """The share of the layer's backward that computes its input gradients, e.g. '48%'; '' when
    not measured or the backward took no time."""
    if layer.bwd_input_ms is None or layer.bwd_ms <= 0:
        return ""
    return f"{layer.bwd_input_ms / layer.bwd_ms:.0%}"


def profile_summary(profile: Profile) -> str:
    """Totals: layer sums against the measured step (and how much longer the instrumented steps took), parameters,
    peak memory (and the CUDA libraries' workspaces), shared parameters."""
    layer_sum = profile.total_fwd_ms + profile.total_bwd_ms
    bwd_input = profile.total_bwd_input_ms
    inputs = "" if bwd_input is None else f" (input gradients {format_ms(bwd_input)} ms)"
    ratio = profile.settings.get("instrumented_ratio")
    step = (
        f"measured step {format_ms(profile.step_ms)} ms"
        + ("" if ratio is None else f" (x{float(ratio):.2f} with the timing hooks)")
        if profile.peak_memory_method != "unknown" else "imported: no measured step"
    )
    peak = (
        f"peak memory {format_bytes(profile.peak_memory_bytes)} ({profile.peak_memory_method})"
        + (f"; libraries' workspaces {format_bytes(profile.library_bytes)} per device" if profile.library_bytes else "")
        if profile.peak_memory_method != "unknown" else "peak memory unknown"
    )
    lines = [
        f"layers: fwd {format_ms(profile.total_fwd_ms)} ms + bwd {format_ms(profile.total_bwd_ms)} ms{inputs} "
        f"= {format_ms(layer_sum)} ms; {step}",
        f"parameters {format_bytes(profile.total_param_bytes)}; {peak}",
    ]
    for shared in profile.shared_params:
        lines.append(
            f"* shared: {', '.join(shared.names)} ({format_bytes(shared.nbytes)}) used by layers "
            f"{', '.join(str(i) for i in shared.layers)}"
        )
    if profile.batch_coupling is not None:
        lines += [f"note: {note}" for note in profile.batch_coupling.notes()]
    missed = profile.settings.get("no_gradient")
    if missed:
        names = ", ".join(missed["names"]) + (", ..." if missed["tensors"] > len(missed["names"]) else "")
        lines.append(f"note: {plural(missed['tensors'], 'parameter tensor')} ({format_bytes(missed['bytes'])}: {names}) "
                     "got no gradient from the example batch; plans count their gradients and optimizer state, as "
                     "real data may reach them (a mixture's experts); if nothing uses them, remove them or set "
                     "requires_grad=False")
    unpadded = profile.settings.get("masks_without_padding")
    if unpadded:
        lines.append(f"note: example_batch() gives {', '.join(unpadded)} of all ones (no padding): leave "
                     f"{'them' if len(unpadded) > 1 else 'it'} out where batches are not padded, as transformers' "
                     "attention then runs the same; a split stage cannot look at a mask's values, so it keeps one "
                     "with its layers and sends it on (memory this profile did not measure where eager attention "
                     "drops it), and on a GPU attention cannot use its flash kernel")
    for size, problem in (profile.settings.get("batch_sizes_not_timed") or {}).items():
        lines.append(f"note: the layers were not timed at batch size {size}: {problem}; `planner partition` does not "
                     "cut a global batch into microbatches of that size, and a plan given it reads the nearest "
                     "measured sizes' times")
    loaded = profile_load_warning(profile.settings.get("conditions") or {})
    if loaded:
        lines.append(f"warning: {loaded}")
    crowded = oversubscribed(profile.settings.get("conditions") or {})
    if crowded:
        lines.append(f"note: measured while {crowded}: the times are a crowded machine's, and training with a core "
                     "per thread runs faster than they predict (profile with --processes x --threads at most the cores)")
    return "\n".join(lines)


def plan_table(plan: Plan, width: int | None = None) -> Table:
    """One row per stage, then the predictions as the caption (no layer count and ranks when narrow)."""
    wide = width is None or width >= NARROW_COLUMNS
    cluster = plan.cluster.describe()
    table = Table(
        title=f"{plan.profile.name}: {len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''} on {cluster} "
        f"({plan.cost_model} cost model)",
        caption=plan_summary(plan), caption_justify="left", **_COMPACT,
    )
    tied = tied_footnote(plan)
    if wide and tied:
        table.caption = f"{table.caption}\n{tied}"
    table.add_column("stage", justify="right", no_wrap=True)
    table.add_column("layers", overflow="fold", min_width=10)
    headers = ("#", "replicas", "ranks", "compute ms", "comm ms", "all-reduce ms", "period ms", "memory/GPU",
               "recompute")
    for header in headers if wide else [h for h in headers if h not in ("#", "ranks", "all-reduce ms")]:
        table.add_column(header, justify="right", no_wrap=True)
    for index, stage in enumerate(plan.stages):
        ranks = rank_range(stage.ranks)
        count = [str(stage.stop - stage.start)] if wide else []
        table.add_row(
            str(index), name_range(stage.first_layer, stage.last_layer), *count, str(stage.replicas),
            *([ranks] if wide else []), format_ms(stage.compute_ms), format_ms(stage.comm_ms),
            *([allreduce_cell(stage)] if wide else []), format_ms(stage.period_ms),
            memory_cell(stage.memory_bytes, plan.cluster.memory_bytes), "yes" if stage.recompute else "no",
        )
    return table


def allreduce_cell(stage: StagePlan) -> str:
    """A stage's all-reduce ms per step: its replicas' plus its tied weights' (marked '*', `tied_footnote`)."""
    total = format_ms(stage.allreduce_ms + stage.tied_allreduce_ms)
    return f"{total}*" if stage.tied_allreduce_ms > 0 else total


def tied_footnote(plan: Plan) -> str | None:
    """The line under a plan table whose all-reduce column holds tied weights' all-reduces; None: no stage has any."""
    tied = [f"stage {index}: {format_ms(stage.tied_allreduce_ms)} ms" for index, stage in enumerate(plan.stages)
            if stage.tied_allreduce_ms > 0]
    if not tied:
        return None
    return (f"* all-reduce ms includes summing tied weights' gradients with the other stages that hold them, once per "
            f"step ({', '.join(tied)})")


def idle_text(plan: Plan) -> str:
    """The plan's idle share of device time as every command states it (`Prediction.bubble_fraction`), and over
    what: the simulated iteration, or pipedream's steady state."""
    over = "in steady state" if plan.microbatches is None else "over the simulated iteration"
    return f"idle {plan.predicted.bubble_fraction:.1%} of device time {over}"


def plan_summary(plan: Plan) -> str:
    """Predicted bottleneck, throughput, idle share and speedups, then the plan's notes."""
    p = plan.predicted
    if plan.microbatches is None:
        timing = f"{significant(p.iteration_ms, 4)} ms per microbatch (steady state, {plan.schedule} schedule)"
    else:
        count = plural(plan.microbatches, "microbatch", "microbatches")
        timing = (f"iteration {significant(p.iteration_ms, 4)} ms ({plan.schedule}, {count} of {plan.microbatch_size}: "
                  f"global batch {plan.global_batch_size})")
    lines = [
        f"{timing}; {significant(p.samples_per_s, 4)} samples/s; {idle_text(plan)}",
        f"speedup {p.speedup_vs_single_device:.3g}x over one GPU, {p.speedup_vs_data_parallel:.3g}x over "
        f"data parallelism on {plural(plan.cluster.num_devices, 'GPU')}; {plural(p.devices_used, 'GPU')} used",
    ]
    return "\n".join(lines + [f"note: {note}" for note in plan.notes])


def comparison_table(plan: Plan, baselines: Sequence[BaselineResult]) -> Table:
    """The plan against baselines (other schedules' best plans, `compare_schedules`, named "best <schedule>"; common
    splits under the same cost model and schedule): time and the plan's speedup."""
    table = Table(title=f"{plan.profile.name}: the plan against other schedules' best plans and common splits "
                        f"({plan.cost_model} cost model, {plan.schedule} schedule for the splits)", **_COMPACT)
    unit = "ms per microbatch" if plan.microbatches is None else "iteration ms"
    for header, justify in (("plan", "left"), ("replicas per stage", "left"), ("GPUs", "right"),
                            (unit, "right"), ("memory/GPU", "right"), ("its time / optimized", "right")):
        table.add_column(header, justify=justify, no_wrap=True)
    optimized_ms = plan.predicted.iteration_ms
    limit = plan.cluster.memory_bytes
    table.add_row("optimized", _replica_shape([s.replicas for s in plan.stages]), str(plan.predicted.devices_used),
                  f"{significant(optimized_ms, 4)}", memory_cell(plan.predicted.peak_memory_bytes, limit), "")
    for baseline in baselines:
        bottleneck_ms = baseline.iteration_s * 1000.0
        fits = limit is None or baseline.peak_memory_bytes <= limit
        memory = memory_cell(baseline.peak_memory_bytes, limit) + ("" if fits else " does not fit")
        speedup = f"{bottleneck_ms / optimized_ms:.2f}x" if optimized_ms > 0 else ""
        table.add_row(baseline.name, _replica_shape([r for _, _, r in baseline.stages]), str(baseline.devices),
                      f"{significant(bottleneck_ms, 4)}", memory, speedup)
    return table


def timeline_table(plan: Plan, timeline: Timeline) -> Table:
    """Per rank of a simulated plan: its stage and replica, compute time, idle share and peak memory;
    the caption compares the simulated iteration with the plan's prediction."""
    table = Table(title=f"{plan.profile.name}: simulated {timeline.schedule} schedule", **_COMPACT)
    for header in ("rank", "stage", "replica", "compute ms", "idle", "peak memory/GPU"):
        table.add_column(header, justify="right", no_wrap=True)
    events = timeline.events
    compute = events[events["op"].isin((FORWARD, BACKWARD, WEIGHT))]
    busy_ms = (compute["end_s"] - compute["start_s"]).groupby(compute["rank"]).sum() * 1000.0
    bubbles = timeline.bubble_fraction()
    memory = timeline.memory().groupby("rank")["bytes"].max()
    owners = events.drop_duplicates("rank").set_index("rank")
    for rank in bubbles.index:
        table.add_row(str(rank), str(owners.at[rank, "stage"]), str(owners.at[rank, "replica"]),
                      format_ms(busy_ms.get(rank, 0.0)), f"{bubbles[rank]:.1%}",
                      memory_cell(int(memory.get(rank, 0)), plan.cluster.memory_bytes))
    simulated_ms = timeline.iteration_s() * 1000.0
    count = plural(timeline.microbatches, "microbatch", "microbatches")
    if timeline.schedule == "pipedream":
        what = f"{significant(simulated_ms, 4)} ms per microbatch in steady state ({count} simulated)"
    else:
        what = f"{significant(simulated_ms, 4)} ms per iteration of {count} ({timeline.iterations} simulated)"
    table.caption = (f"{what}; the plan states {significant(plan.predicted.iteration_ms, 4)} ms; "
                     f"{timeline_idle_text(plan, timeline)}")
    table.caption_justify = "left"
    return table


def timeline_idle_text(plan: Plan, timeline: Timeline) -> str:
    """The simulated idle share of device time (`Timeline.idle_fraction`: for a flush schedule the plan's figure)
    and the worst rank's; for pipedream, over the whole run with its fill and drain, beside the plan's steady state."""
    bubbles = timeline.bubble_fraction()
    worst = f"worst rank {bubbles.max():.1%}" if len(bubbles) else "no ranks"
    if timeline.schedule != "pipedream":
        return f"idle {timeline.idle_fraction():.1%} of device time (mean of the ranks; {worst})"
    return (f"idle {timeline.idle_fraction():.1%} of device time over the simulated run, fill and drain included "
            f"(mean of the ranks; {worst}; the plan states {plan.predicted.bubble_fraction:.1%} in steady state)")


def rank_range(ranks: Sequence[int]) -> str:
    """'3' for one rank, '0-3' for a contiguous block."""
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _replica_shape(replicas: list[int]) -> str:
    """'4-2-1', or 'N stages' when that would be long."""
    shape = "-".join(str(r) for r in replicas)
    return shape if len(shape) <= 24 else f"{len(replicas)} stages"


def memory_cell(memory_bytes: int, limit_bytes: int | None) -> str:
    """'12.3 GB' or, with a limit, '12.3 GB (15%)' of the limit (decimal GB, as --memory takes)."""
    text = f"{significant(memory_bytes / 1e9)} GB"
    return text if limit_bytes is None else f"{text} ({memory_bytes / limit_bytes:.0%})"
