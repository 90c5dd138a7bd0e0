"""Readable tables of profiles for the terminal (rich) and for Jupyter (HTML)."""

from __future__ import annotations

from rich.table import Table

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
