"""Readable tables of profiles for the terminal (rich) and for Jupyter (HTML)."""

from __future__ import annotations

from typing import Sequence

from rich.table import Table

from planner.partition import BaselineResult
from planner.plan import Plan
from planner.profile import Profile
from planner.units import format_bytes, format_ms


def profile_table(profile: Profile) -> Table:
    """One row per layer: times in ms per mini-batch, sizes in binary units."""
    batch = "?" if profile.batch_size is None else str(profile.batch_size)
    table = Table(
        title=f"{profile.model_name}: {profile.num_layers} layers on {profile.device_name} "
        f"({profile.device}, {profile.dtype}, batch {batch})",
        caption=profile_summary(profile),
    )
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("layer", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    for header in ("fwd ms", "bwd ms", "output", "cut", "params", "saved"):
        table.add_column(header, justify="right", no_wrap=True)
    shared_layers = {index for shared in profile.shared_params for index in shared.layers}
    for index, layer in enumerate(profile.layers):
        params = format_bytes(layer.param_bytes) + (" *" if index in shared_layers else "")
        kind = layer.kind if len(layer.kind) <= 40 else layer.kind[:37] + "..."
        table.add_row(
            str(index), layer.name, kind, format_ms(layer.fwd_ms), format_ms(layer.bwd_ms),
            format_bytes(layer.output_bytes), format_bytes(layer.cut_bytes), params,
            format_bytes(layer.saved_bytes),
        )
    return table


def profile_summary(profile: Profile) -> str:
    """Totals: layer sums against the measured step, parameters, peak memory, shared parameters."""
    layer_sum = profile.total_fwd_ms + profile.total_bwd_ms
    lines = [
        f"layers: fwd {format_ms(profile.total_fwd_ms)} ms + bwd {format_ms(profile.total_bwd_ms)} ms "
        f"= {format_ms(layer_sum)} ms; measured step {format_ms(profile.step_ms)} ms",
        f"parameters {format_bytes(profile.total_param_bytes)}; peak memory "
        f"{format_bytes(profile.peak_memory_bytes)} ({profile.peak_memory_method})",
    ]
    for shared in profile.shared_params:
        lines.append(
            f"* shared: {', '.join(shared.names)} ({format_bytes(shared.nbytes)}) used by layers "
            f"{', '.join(str(i) for i in shared.layers)}"
        )
    return "\n".join(lines)


def plan_table(plan: Plan) -> Table:
    """One row per stage, then the predictions as the caption."""
    cluster = plan.cluster.describe()
    table = Table(
        title=f"{plan.profile.name}: {len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''} on {cluster} "
        f"({plan.cost_model} cost model)",
        caption=plan_summary(plan),
    )
    for header, justify in (("stage", "right"), ("layers", "left"), ("#", "right"), ("replicas", "right"),
                            ("ranks", "left"), ("compute ms", "right"), ("comm ms", "right"),
                            ("stage value ms", "right"), ("memory/GPU", "right")):
        table.add_column(header, justify=justify, no_wrap=True)
    for index, stage in enumerate(plan.stages):
        ranks = f"{stage.ranks[0]}" if len(stage.ranks) == 1 else f"{stage.ranks[0]}-{stage.ranks[-1]}"
        table.add_row(
            str(index), f"{stage.first_layer} .. {stage.last_layer}", str(stage.stop - stage.start),
            str(stage.replicas), ranks, format_ms(stage.compute_ms), format_ms(stage.comm_ms),
            format_ms(stage.value_ms), memory_cell(stage.memory_bytes, plan.cluster.memory_bytes),
        )
    return table


def plan_summary(plan: Plan) -> str:
    """Predicted bottleneck, throughput and speedups, then the plan's notes."""
    p = plan.predicted
    lines = [
        f"bottleneck {p.bottleneck_s * 1000:.4g} ms per mini-batch; {p.samples_per_s:.4g} samples/s; "
        f"idle share {p.bubble_fraction:.1%}",
        f"speedup {p.speedup_vs_single_device:.3g}x over one GPU, {p.speedup_vs_data_parallel:.3g}x over "
        f"data parallelism on {plan.cluster.num_devices} GPUs; {p.devices_used} GPUs used",
    ]
    return "\n".join(lines + list(plan.notes))


def comparison_table(plan: Plan, baselines: Sequence[BaselineResult]) -> Table:
    """The plan against baselines under the same cost model: bottleneck and the plan's speedup."""
    table = Table(title=f"{plan.profile.name}: the plan against common splits ({plan.cost_model} cost model)")
    for header, justify in (("plan", "left"), ("replicas per stage", "left"), ("GPUs", "right"),
                            ("bottleneck ms", "right"), ("optimized plan is", "right")):
        table.add_column(header, justify=justify, no_wrap=True)
    optimized_ms = plan.predicted.bottleneck_s * 1000.0
    rows = [("optimized", [s.replicas for s in plan.stages], plan.predicted.devices_used, optimized_ms)]
    rows += [(b.name, [r for _, _, r in b.stages], b.devices, b.bottleneck_s * 1000.0) for b in baselines]
    for name, replicas, devices, bottleneck_ms in rows:
        shape = "-".join(str(r) for r in replicas)
        if len(shape) > 30:
            shape = f"{len(replicas)} stages"
        speedup = "" if name == "optimized" else f"{bottleneck_ms / optimized_ms:.2f}x faster"
        table.add_row(name, shape, str(devices), f"{bottleneck_ms:.4g}", speedup)
    return table


def memory_cell(memory_bytes: int, limit_bytes: int | None) -> str:
    """'12.3 GiB' or, with a limit, '12.3 GiB / 80 GB (15%)'."""
    if limit_bytes is None:
        return format_bytes(memory_bytes)
    return f"{format_bytes(memory_bytes)} ({memory_bytes / limit_bytes:.0%} of {limit_bytes / 1e9:.3g} GB)"
