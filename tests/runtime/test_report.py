"""Run reports from traces: every figure of a hand-made two-rank run, clock alignment, the simulator
played back as a run (measured = predicted; also interleaved-1f1b, whose ranks run several stages), and
gathering under torchrun.

Run as a script (`python -m torch.distributed.run --nproc-per-node=2 test_report.py OUT`), this file
is the torchrun worker of `test_save_run_report_gathers_every_rank_under_torchrun`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from planner.files.cluster import make_cluster
from planner.planning.partition import partition
from planner.simulation.plan_simulation import plan_cost_inputs
from planner.files.plan import Plan, StagePlan
from planner.simulation.plan_simulation import simulate
from planner.files.profile import Profile, load_profile
from planner.files.run_report import RunReportError, comparison_table, load_run_report
from planner.costs.schedule_cost import first_ranks, samples_per_s, stage_costs
from planner.files.timeline import COLUMNS, Timeline
from planner.schedules.schedule import SEND_ACTIVATION, SEND_GRADIENT
from runtime.report import RankTrace, _boundary_transfer_ms, build_run_report, save_run_report, write_run_report
from tests.replay import replay_timeline
from runtime.trace import OpTime


def report_body(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """`build_run_report`'s report as the file body it writes (the schema under test)."""
    return build_run_report(*args, **kwargs).to_dict()

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- a hand-made run of 2 ranks
# gpipe, 2 microbatches, one rank per stage. Each op: (rank, op, microbatch, peer, start, end) in
# ms from the step's start at scale 1; step k runs SCALES[k] times slower. Rank 1 starts its step
# 0.2 ms before rank 0; rank 0 ends last, at 14: the job's step takes 14.2 ms at scale 1.

LAYOUT = [
    (0, "forward", 0, None, 0.0, 2.0), (0, "send_activation", 0, 1, 2.0, 2.5), (0, "forward", 1, None, 2.0, 4.0),
    (0, "send_activation", 1, 1, 4.0, 4.5), (0, "recv_gradient", 0, 1, 4.0, 7.0), (0, "backward", 0, None, 7.0, 10.0),
    (0, "recv_gradient", 1, 1, 10.0, 10.0), (0, "backward", 1, None, 10.0, 13.0), (0, "step", -1, None, 13.0, 13.5),
    (1, "recv_activation", 0, 0, 0.0, 2.5), (1, "forward", 0, None, 2.5, 3.5), (1, "recv_activation", 1, 0, 3.5, 4.5),
    (1, "forward", 1, None, 4.5, 5.5), (1, "backward", 0, None, 5.5, 6.5), (1, "send_gradient", 0, 0, 6.5, 7.0),
    (1, "backward", 1, None, 6.5, 7.5), (1, "send_gradient", 1, 0, 7.5, 8.0), (1, "step", -1, None, 7.5, 8.0),
]
SPANS = {0: (0.0, 14.0), 1: (-0.2, 8.2)}
SCALES = [3.0, 1.0, 2.0, 1.5]  # step 0 is the warm-up; measured: 14.2, 28.4 and 21.3 ms, median 21.3 (step 3)
STEP_START_S = [5000.0 + 10.0 * k for k in range(len(SCALES))]  # each step's start on the common clock
OFFSETS = {0: 1000.123, 1: -7.5}  # rank clock + offset = common clock
BATCH = 8


def hand_made_traces(offsets: dict[int, float] = OFFSETS, hostname: str = "host") -> list[RankTrace]:
    """LAYOUT run for every step of SCALES, each rank on its own clock (common - offset)."""
    traces = []
    for rank in (0, 1):
        def local(k: int, ms: float, rank: int = rank) -> float:
            return STEP_START_S[k] + ms * SCALES[k] / 1000.0 - offsets[rank]

        ops = tuple(OpTime(k, op, 0, microbatch, peer, local(k, start), local(k, end))
                    for k in range(len(SCALES)) for r, op, microbatch, peer, start, end in LAYOUT if r == rank)
        spans = tuple((local(k, SPANS[rank][0]), local(k, SPANS[rank][1])) for k in range(len(SCALES)))
        traces.append(RankTrace(rank, rank, 0, hostname, offsets[rank], ops, spans, 2, "gpipe"))
    return traces


def hand_made_plan() -> Plan:
    """A 2-stage gpipe plan of the mlp profile, with round predictions to compare against."""
    plan = partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(2, None, ["1GB/s"]), straight=True,
                     schedule="gpipe", microbatches=2, microbatch_size=4)
    first, second = plan.stages
    stages = (dataclasses.replace(first, ranks=(0,), compute_ms=5.0, comm_ms=0.5, allreduce_ms=0.0, step_ms=0.0,
                                  accumulate_ms=0.0),
              dataclasses.replace(second, ranks=(1,), compute_ms=3.0, comm_ms=0.5, allreduce_ms=0.0, step_ms=0.0,
                                  accumulate_ms=0.0))
    predicted = dataclasses.replace(plan.predicted, iteration_ms=20.0, samples_per_s=400.0)
    return dataclasses.replace(plan, stages=stages, predicted=predicted)


@pytest.fixture(scope="module")
def plan() -> Plan:
    return hand_made_plan()


@pytest.fixture(scope="module")
def body(plan: Plan) -> dict[str, Any]:
    return report_body(plan, hand_made_traces(), batch_size=BATCH, losses=[(1, 2.5), (2, 2.25)],
                            plan_path="plan.json", meta={"backend": "gloo"})


def test_step_times_leave_out_the_warmup_and_take_the_median(body: dict[str, Any]) -> None:
    measured = body["measured"]
    assert measured["steps"] == 3 and measured["warmup_steps"] == 1
    assert measured["step_times_ms"] == pytest.approx([14.2, 28.4, 21.3], abs=1e-6)
    assert measured["train_step_ms"] == pytest.approx(21.3, abs=1e-6)
    assert measured["iteration_ms"] == pytest.approx(21.3, abs=1e-6)
    assert measured["samples_per_s"] == pytest.approx(BATCH / 0.0213, rel=1e-6)
    assert measured["representative_step"] == 3
    assert (measured["batch_size"], measured["microbatches"], measured["microbatch_size"]) == (8, 2, 4.0)
    assert measured["ranks"] == [{"rank": 0, "stage": 0, "replica": 0, "hostname": "host"},
                                 {"rank": 1, "stage": 1, "replica": 0, "hostname": "host"}]


def test_every_stage_figure_of_the_hand_made_run(body: dict[str, Any]) -> None:
    mean = sum(SCALES[1:]) / 3  # every duration scales with its step; means over steps 1-3 scale by 1.5
    step_ms = 14.2 * mean
    first, second = body["measured"]["stages"]
    expected_first = dict(forward_ms=2.0 * mean, backward_ms=3.0 * mean, compute_ms=5.0 * mean, comm_ms=0.5 * mean,
                          send_ms=1.0 * mean, recv_wait_ms=3.0 * mean, allreduce_ms=0.0, allreduce_each_ms=0.0,
                          step_ms=0.5 * mean, busy_ms=10.5 * mean, idle_ms=(14.2 - 10.5) * mean,
                          idle_fraction=(14.2 - 10.5) * mean / step_ms, peak_memory_bytes=0.0)
    expected_second = dict(forward_ms=1.0 * mean, backward_ms=1.0 * mean, compute_ms=2.0 * mean, comm_ms=0.5 * mean,
                           send_ms=1.0 * mean, recv_wait_ms=3.5 * mean, allreduce_ms=0.0, allreduce_each_ms=0.0,
                           step_ms=0.5 * mean, busy_ms=4.5 * mean, idle_ms=(14.2 - 4.5) * mean,
                           idle_fraction=(14.2 - 4.5) * mean / step_ms, peak_memory_bytes=0.0)
    assert first == pytest.approx(expected_first, abs=1e-6)
    assert second == pytest.approx(expected_second, abs=1e-6)


def test_predictions_ratios_plan_and_losses(plan: Plan, body: dict[str, Any]) -> None:
    assert body["predicted"] == {"iteration_ms": 20.0, "samples_per_s": 400.0, "stages": [
        {"compute_ms": 5.0, "comm_ms": 0.5, "allreduce_ms": 0.0, "step_ms": 0.0,
         "peak_memory_bytes": float(plan.stages[0].memory_bytes)},
        {"compute_ms": 3.0, "comm_ms": 0.5, "allreduce_ms": 0.0, "step_ms": 0.0,
         "peak_memory_bytes": float(plan.stages[1].memory_bytes)}]}
    ratios = body["ratios"]
    assert ratios["iteration_ms"] == pytest.approx(21.3 / 20.0)
    assert ratios["samples_per_s"] == pytest.approx(BATCH / 0.0213 / 400.0)
    assert [s["compute_ms"] for s in ratios["stages"]] == pytest.approx([7.5 / 5.0, 3.0 / 3.0])
    assert body["losses"] == [[1, 2.5], [2, 2.25]]
    assert body["meta"] == {"backend": "gloo"}
    assert body["notes"] == []
    section = body["plan"]
    assert (section["path"], section["schedule"], section["microbatches"], section["microbatch_size"]) == \
        ("plan.json", "gpipe", 2, 4)
    assert [s["ranks"] for s in section["stages"]] == [[0], [1]]
    assert [s["layers"] for s in section["stages"]] == [[s.start, s.stop] for s in plan.stages]
    assert section["profile"] == {"name": plan.profile.name, "digest": plan.profile.digest}


def expected_events(step: int) -> list[list[Any]]:
    """LAYOUT's rows but receives in COLUMNS order, seconds from the job's start of `step`, sorted as the simulator."""
    start_ms = min(span[0] for span in SPANS.values())
    rows = [[rank, rank, 0, microbatch, 0, op, -1 if peer is None else peer,
             (start - start_ms) * SCALES[step] / 1000.0, (end - start_ms) * SCALES[step] / 1000.0]
            for rank, op, microbatch, peer, start, end in LAYOUT if not op.startswith("recv")]
    return sorted(rows, key=lambda row: (row[7], row[0]))


def assert_same_events(found: list[list[Any]], expected: list[list[Any]]) -> None:
    assert len(found) == len(expected)
    for row, want in zip(found, expected):
        assert row[:7] == want[:7]
        assert row[7:] == pytest.approx(want[7:], abs=1e-9)


def test_events_are_the_median_step_on_the_common_clock_without_receives(body: dict[str, Any]) -> None:
    assert len(body["events"][0]) == len(COLUMNS)
    assert_same_events(body["events"], expected_events(3))


def test_events_align_ranks_whatever_their_clocks(plan: Plan, body: dict[str, Any]) -> None:
    shifted = report_body(plan, hand_made_traces({0: -123.4, 1: 98765.0}), batch_size=BATCH, losses=[])
    assert_same_events(shifted["events"], body["events"])
    for found, expected in zip(shifted["measured"]["stages"], body["measured"]["stages"]):
        assert found == pytest.approx(expected, abs=1e-6)
    assert shifted["measured"]["step_times_ms"] == pytest.approx(body["measured"]["step_times_ms"], abs=1e-6)
    # rank 1 believing its clock 1 ms behind shifts its ops 1 ms later against rank 0's
    traces = hand_made_traces()
    traces[1] = dataclasses.replace(traces[1], clock_offset_s=traces[1].clock_offset_s + 0.001)
    late = report_body(plan, traces, batch_size=BATCH, losses=[], warmup_steps=3)
    rows = {(row[0], row[5], row[3]): row for row in late["events"]}
    gap = rows[(1, "forward", 0)][7] - rows[(0, "forward", 0)][7]
    assert gap == pytest.approx((2.5 * 1.5) / 1000.0 + 0.001, abs=1e-9)


def test_no_warmup_measures_every_step(plan: Plan) -> None:
    body = report_body(plan, hand_made_traces(), batch_size=BATCH, losses=[], warmup_steps=0)
    assert body["measured"]["steps"] == 4
    assert body["measured"]["step_times_ms"] == pytest.approx([42.6, 14.2, 28.4, 21.3], abs=1e-6)
    assert body["measured"]["iteration_ms"] == pytest.approx((28.4 + 21.3) / 2, abs=1e-6)  # median of an even count
    assert body["measured"]["representative_step"] == 3  # the shorter of the middle two


def test_peak_memory_is_the_most_a_stage_rank_needed_against_the_plans(plan: Plan) -> None:
    first, second = hand_made_traces()
    traces = [dataclasses.replace(first, peak_memory_bytes=3_000_000, memory_method="live-tensors"), second]
    body = report_body(plan, traces, batch_size=BATCH, losses=[])
    assert [s["peak_memory_bytes"] for s in body["measured"]["stages"]] == [3e6, 0.0]  # 0: not measured
    assert [s["peak_memory_bytes"] for s in body["predicted"]["stages"]] == [float(s.memory_bytes) for s in plan.stages]
    assert body["ratios"]["stages"][0]["peak_memory_bytes"] == pytest.approx(3e6 / plan.stages[0].memory_bytes)
    assert body["ratios"]["stages"][1]["peak_memory_bytes"] is None
    assert body["measured"]["memory_method"] == "live-tensors"


def test_notes_when_the_run_used_other_microbatches_than_the_plan(plan: Plan) -> None:
    traces = [dataclasses.replace(trace, microbatches=4) for trace in hand_made_traces()]
    notes = report_body(plan, traces, batch_size=8, losses=[])["notes"]
    assert any("4 microbatches" in note and "2" in note for note in notes)
    assert any("2 samples" in note for note in notes)


@pytest.mark.parametrize("change, fragment", [
    (lambda ts: ts[:1], "ranks [0]"),
    (lambda ts: [ts[0], dataclasses.replace(ts[1], stage=0)], "rank 1 ran stage 0"),
    (lambda ts: [dataclasses.replace(t, schedule="1f1b") for t in ts], "1f1b schedule"),
    (lambda ts: [ts[0], dataclasses.replace(ts[1], step_spans=ts[1].step_spans[:3])], "different numbers"),
    (lambda ts: [ts[0], dataclasses.replace(ts[1], microbatches=4)], "different microbatch counts"),
    (lambda ts: [ts[0], dataclasses.replace(ts[1], ops=ts[1].ops + (OpTime(0, "nap", 0, 0, None, 0.0, 1.0),))],
     "unknown op 'nap'"),
    (lambda ts: [ts[0], dataclasses.replace(ts[1], ops=ts[1].ops + (OpTime(-1, "step", 0, -1, None, 0.0, 1.0),))],
     "step -1"),
])
def test_traces_that_do_not_fit_the_plan_are_refused(plan: Plan, change: Any, fragment: str) -> None:
    with pytest.raises(RunReportError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        report_body(plan, change(hand_made_traces()), batch_size=BATCH, losses=[])


def test_no_step_left_after_the_warmup_is_refused(plan: Plan) -> None:
    with pytest.raises(RunReportError, match="none is left to measure"):
        report_body(plan, hand_made_traces(), batch_size=BATCH, losses=[], warmup_steps=4)


def test_only_steps_traced_on_every_rank_are_measured(plan: Plan, body: dict[str, Any]) -> None:
    """The engine keeps the ops of its last steps only; an unfinished step has ops but no span."""
    first, second = hand_made_traces()
    unfinished = tuple(dataclasses.replace(op, step=4) for op in second.ops if op.step == 3)
    second = dataclasses.replace(second, ops=tuple(op for op in second.ops if op.step != 2) + unfinished)
    partial = report_body(plan, [first, second], batch_size=BATCH, losses=[])
    assert partial["measured"]["steps"] == 2
    assert partial["measured"]["step_times_ms"] == pytest.approx([14.2, 21.3], abs=1e-6)
    mean = (SCALES[1] + SCALES[3]) / 2
    assert partial["measured"]["stages"][0]["compute_ms"] == pytest.approx(5.0 * mean, abs=1e-6)
    assert partial["measured"]["stages"][1]["recv_wait_ms"] == pytest.approx(3.5 * mean, abs=1e-6)
    assert any("2 of the 3 steps" in note for note in partial["notes"])
    with pytest.raises(RunReportError, match="op timings on every rank"):
        report_body(plan, [first, dataclasses.replace(second, ops=())], batch_size=BATCH, losses=[])


def test_written_report_loads_back(tmp_path: Path, plan: Plan, body: dict[str, Any]) -> None:
    built = build_run_report(plan, hand_made_traces(), batch_size=BATCH, losses=[(1, 2.5), (2, 2.25)],
                             plan_path="plan.json", meta={"backend": "gloo"})
    report = load_run_report(write_run_report(tmp_path / "run.json", built))
    assert report.to_dict() == body  # every field the file has comes back, ratios derived alike
    assert json.loads((tmp_path / "run.json").read_text())["format"] == "pipeline-planner/run-report"
    assert report.iteration_ms == body["measured"]["iteration_ms"]
    assert report.measured[0].compute_ms == body["measured"]["stages"][0]["compute_ms"]
    assert report.events.values.tolist() == body["events"]
    assert report.losses == ((1, 2.5), (2, 2.25))


# ---------------------------------------------------------------- the simulator played back


def reshaped(plan: Plan, profile: Profile, shape: list[tuple[int, int, int, bool]]) -> Plan:
    """`plan` with stages `shape` (start, stop, replicas, recompute), their terms from the cost model
    and the simulated iteration as the prediction (as `partition` states them)."""
    inputs = plan_cost_inputs(profile, plan)
    stages = tuple(
        StagePlan(start, stop, profile.layers[start].name, profile.layers[stop - 1].name, replicas,
                  tuple(range(first, first + replicas)), recompute, cost.compute_s * 1e3,
                  max(cost.comm_in_s, cost.comm_out_s) * 1e3, cost.allreduce_s * 1e3, cost.period_s * 1e3,
                  int(cost.memory_bytes), cost.step_s * 1e3, cost.accumulate_s * 1e3)
        for (start, stop, replicas, recompute), cost, first in zip(shape, stage_costs(inputs, shape),
                                                                   first_ranks(inputs, shape)))
    new = dataclasses.replace(plan, stages=stages)
    iteration_s = simulate(new, profile).iteration_s()
    predicted = dataclasses.replace(plan.predicted, iteration_ms=iteration_s * 1e3,
                                    samples_per_s=samples_per_s(inputs, iteration_s, plan.microbatch_size))
    return dataclasses.replace(new, predicted=predicted)


SHAPES = {
    "1f1b-straight": ("1f1b", 4, [(0, 3, 1, False), (3, 6, 1, False), (6, 9, 1, False), (9, 13, 1, False)]),
    "gpipe-2-1-recompute": ("gpipe", 3, [(0, 5, 2, True), (5, 13, 1, False)]),
    "1f1b-1-2": ("1f1b", 3, [(0, 7, 1, False), (7, 13, 2, True)]),
    "pipedream-straight": ("pipedream", 3, [(0, 4, 1, False), (4, 8, 1, False), (8, 13, 1, False)]),
    "pipedream-2-1": ("pipedream", 3, [(0, 6, 2, False), (6, 13, 1, False)]),
}


@pytest.fixture(scope="module")
def mlp() -> Profile:
    return load_profile(REPO / "profiles" / "mlp.json")


@pytest.mark.parametrize("name", SHAPES)
def test_a_run_that_went_as_simulated_measures_what_was_predicted(mlp: Profile, name: str) -> None:
    schedule, gpus, shape = SHAPES[name]
    base = partition(mlp, make_cluster(gpus, None, ["1GB/s"]), schedule=schedule,
                     microbatches=6 if schedule != "pipedream" else "auto")
    plan = reshaped(base, mlp, shape)
    timeline = simulate(plan, mlp)
    offsets = {rank: 1000.0 * rank - 3.7 for rank in range(gpus)}
    batch = timeline.microbatches * plan.microbatch_size
    body = report_body(plan, replay_timeline(timeline, 3, clock_offsets_s=offsets), batch_size=batch, losses=[])
    assert body["ratios"]["iteration_ms"] == pytest.approx(1.0, rel=1e-6)
    assert body["ratios"]["samples_per_s"] == pytest.approx(1.0, rel=1e-6)
    assert body["measured"]["steps"] == 2
    scale = plan.microbatch_size / mlp.batch_size
    bubbles = timeline.bubble_fraction()
    for index, (found, stage) in enumerate(zip(body["measured"]["stages"], plan.stages)):
        layers = mlp.layers[stage.start:stage.stop]
        fwd_ms = scale * sum(layer.fwd_ms for layer in layers)
        both_ms = scale * sum(layer.fwd_ms + layer.bwd_ms for layer in layers)
        assert found["forward_ms"] == pytest.approx(fwd_ms, rel=1e-6)
        accumulated = plan.mean_compute_ms(index) - stage.compute_ms  # microbatches after a replica's first
        assert found["compute_ms"] == pytest.approx(both_ms + (fwd_ms if stage.recompute else 0.0) + accumulated,
                                                    rel=1e-6)
        assert body["ratios"]["stages"][index]["compute_ms"] == pytest.approx(1.0, rel=1e-6)
        assert found["comm_ms"] == pytest.approx(stage.comm_ms, rel=1e-6)
        assert found["allreduce_each_ms"] == pytest.approx(stage.allreduce_ms, rel=1e-6)
        assert (found["allreduce_ms"] > 0) == (stage.replicas > 1)
        if stage.replicas > 1:  # per step: one all-reduce (flush) or one per microbatch a replica takes
            assert found["allreduce_ms"] == pytest.approx(body["predicted"]["stages"][index]["allreduce_ms"], rel=1e-6)
        if schedule != "pipedream":  # the simulator's idle share: not computing nor all-reducing
            assert found["idle_fraction"] == pytest.approx(float(bubbles[list(stage.ranks)].mean()), rel=1e-6)
    def ordered(rows: list[list[Any]]) -> list[list[Any]]:
        return sorted(rows, key=lambda row: (tuple(row[:7]), row[7]))

    found, expected = ordered(body["events"]), ordered(timeline.events.values.tolist())
    assert [row[:7] for row in found] == [row[:7] for row in expected]
    assert [t for row in found for t in row[7:]] == pytest.approx([t for row in expected for t in row[7:]], abs=1e-9)


# ---------------------------------------------------------------- interleaved-1f1b: ranks of several stages


@pytest.fixture(scope="module")
def gpt() -> Profile:
    return load_profile(REPO / "profiles" / "gpt.json")


@pytest.fixture(scope="module")
def interleaved(gpt: Profile) -> Plan:
    """gpt on 2 ranks of 2 stages each (stage s on rank s mod 2): the tied embedding (stage 0) and head
    (stage 3) on different ranks."""
    plan = partition(gpt, make_cluster(2, None, ["1GB/s"]), schedule="interleaved-1f1b", microbatches=4)
    assert plan.chunks == 2 and [stage.ranks for stage in plan.stages] == [(0,), (1,), (0,), (1,)]
    return plan


def replayed_with_stages(timeline: Timeline, steps: int = 3) -> list[RankTrace]:
    """`replay_timeline`'s traces with what the engine records of a rank of several stages: each op's stage and
    the rank's stages (`replay_timeline` gives each op stage -1 and each rank its first stage)."""
    traces = []
    for trace in replay_timeline(timeline, steps):
        rows = timeline.events[timeline.events["rank"] == trace.rank]  # in replay_timeline's order, step by step
        stages = [int(stage) for _ in range(steps) for stage in rows["stage"]]
        ops = tuple(dataclasses.replace(op, stage=stage) for op, stage in zip(trace.ops, stages, strict=True))
        traces.append(dataclasses.replace(trace, ops=ops, stages=tuple(sorted({*stages}))))
    return traces


@pytest.fixture(scope="module")
def interleaved_traces(gpt: Profile, interleaved: Plan) -> list[RankTrace]:
    return replayed_with_stages(simulate(interleaved, gpt))


def test_an_interleaved_run_that_went_as_simulated_measures_every_stage_as_predicted(
        gpt: Profile, interleaved: Plan, interleaved_traces: list[RankTrace]) -> None:
    """Forward, backward and transfers are each stage's own; the optimizer step, the tied all-reduce and
    idle time are the rank's (once for all its stages), against the plan's sum over the rank's stages."""
    timeline = simulate(interleaved, gpt)
    report = build_run_report(interleaved, interleaved_traces, batch_size=4 * interleaved.microbatch_size, losses=[])
    body, table = report.to_dict(), comparison_table(report)
    assert body["ratios"]["iteration_ms"] == pytest.approx(1.0, rel=1e-6)
    assert [row["stage"] for row in body["measured"]["ranks"]] == [0, 1]  # a rank's first stage
    bubbles = timeline.bubble_fraction()
    for index, (found, expected, stage) in enumerate(zip(body["measured"]["stages"], body["predicted"]["stages"],
                                                         interleaved.stages)):
        rank_stages = [other for other in interleaved.stages if other.ranks == stage.ranks]
        assert found["forward_ms"] > 0 and body["ratios"]["stages"][index]["compute_ms"] == pytest.approx(1.0)
        assert found["comm_ms"] == pytest.approx(stage.comm_ms, rel=1e-6)
        assert expected["step_ms"] == pytest.approx(sum(other.step_ms for other in rank_stages))
        assert found["step_ms"] == pytest.approx(expected["step_ms"], rel=1e-6)
        tied_ms = sum(other.tied_allreduce_ms for other in rank_stages)  # one tied stage per rank
        assert tied_ms > 0 and expected["allreduce_ms"] == pytest.approx(tied_ms)
        assert found["allreduce_ms"] == pytest.approx(expected["allreduce_ms"], rel=1e-6)
        assert found["idle_fraction"] == pytest.approx(float(bubbles[stage.ranks[0]]), rel=1e-6)
        rows = table.loc[f"stage {index} compute (ms/microbatch)":f"stage {index} step (ms)", "measured"]
        assert not rows.isna().any()
    assert {(row[0], row[1]) for row in body["events"]} == {(0, 0), (0, 2), (1, 1), (1, 3)}

    def ordered(rows: list[list[Any]]) -> list[list[Any]]:
        return sorted(rows, key=lambda row: (tuple(row[:7]), row[7]))

    found_events, expected_events = ordered(body["events"]), ordered(timeline.events.values.tolist())
    assert [row[:7] for row in found_events] == [row[:7] for row in expected_events]


def test_an_interleaved_stages_peak_memory_is_its_ranks_against_the_plans_per_device_peak(
        interleaved: Plan, interleaved_traces: list[RankTrace]) -> None:
    traces = [dataclasses.replace(trace, peak_memory_bytes=peak, memory_method="live-tensors")
              for trace, peak in zip(interleaved_traces, (3_000_000, 2_000_000))]
    body = report_body(interleaved, traces, batch_size=4 * interleaved.microbatch_size, losses=[])
    assert [s["peak_memory_bytes"] for s in body["measured"]["stages"]] == [3e6, 2e6, 3e6, 2e6]
    assert [s["peak_memory_bytes"] for s in body["predicted"]["stages"]] == \
        [float(stage.memory_bytes) for stage in interleaved.stages]


@pytest.mark.parametrize("change, fragment", [
    (lambda ts: [dataclasses.replace(ts[0], stages=()), ts[1]],
     "rank 0 ran stage 0, but the plan puts it on stages 0, 2"),
    (lambda ts: [ts[0], dataclasses.replace(ts[1], stages=(1, 3, 5))], "rank 1 ran stages 1, 3, 5, but the plan"),
    (lambda ts: [dataclasses.replace(ts[0], ops=ts[0].ops + (OpTime(1, "forward", 0, 0, None, 0.0, 1.0, 1),)), ts[1]],
     "rank 0: an op of stage 1, but it ran stages 0, 2"),
])
def test_interleaved_traces_that_do_not_fit_the_plan_are_refused(interleaved: Plan, interleaved_traces: list[RankTrace],
                                                                 change: Any, fragment: str) -> None:
    with pytest.raises(RunReportError, match=fragment):
        report_body(interleaved, change(interleaved_traces), batch_size=4 * interleaved.microbatch_size, losses=[])


def test_a_boundary_transfer_is_the_stages_beside_it_not_every_stage_of_their_ranks() -> None:
    """Stages 0 and 2 on rank 0, 1 and 3 on rank 1: each boundary takes the activations of the stage below it
    and the gradients of the stage above it, though the same two ranks send both."""
    def send(op: str, peer: int, ms: float, stage: int) -> OpTime:
        return OpTime(1, op, 0, 0, peer, 0.0, ms / 1000.0, stage)

    ops = {(0, 1): [send(SEND_ACTIVATION, 1, 1.0, 0), send(SEND_ACTIVATION, 1, 3.0, 2), send(SEND_GRADIENT, 1, 9.0, 2)],
           (1, 1): [send(SEND_ACTIVATION, 0, 2.0, 1), send(SEND_GRADIENT, 0, 5.0, 1), send(SEND_GRADIENT, 0, 7.0, 3)]}
    assert _boundary_transfer_ms(ops, [[0], [1], [0], [1]], [1]) == pytest.approx([3.0, 5.5, 5.0])


# ---------------------------------------------------------------- gathering under torchrun


class FakeEngine(SimpleNamespace):
    """What rank_trace reads of an Engine."""


def worker(out: Path) -> None:
    """On every rank: an engine-like object holding this rank's hand-made trace (times on the
    common clock, as the same machine's ranks share perf_counter), then save_run_report."""
    from runtime.engine import init_distributed

    rank, _, device = init_distributed("gloo")
    mine = hand_made_traces({0: 0.0, 1: 0.0})[rank]
    engine = FakeEngine(rank=rank, stage=mine.stage, replica=mine.replica, microbatches=mine.microbatches,
                        schedule=SimpleNamespace(name=mine.schedule), trace=list(mine.ops),
                        step_spans=list(mine.step_spans), device=device)
    losses = [(1, 2.5), (2, 2.25)] if rank == 1 else []  # only the last stage knows the loss
    written = save_run_report(engine, hand_made_plan(), out / "run.json", batch_size=BATCH, losses=losses)
    (out / f"rank{rank}.json").write_text(json.dumps({"returned": None if written is None else str(written)}))
    train_the_mlp(out)


def train_the_mlp(out: Path) -> None:
    """On every rank: 4 steps of the real engine on hand_made_plan's mlp, then its report as engine.json."""
    import torch

    from planner.profiling.model_file import load_model_file
    from runtime.engine import Engine

    example = load_model_file(REPO / "examples" / "mlp.py")
    torch.manual_seed(0)
    model = example.build_model()
    torch.manual_seed(1)
    inputs, target = example.example_batch(BATCH)
    plan = hand_made_plan()
    with Engine.from_plan(model, plan, optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
                          loss_fn=example.loss_fn) as engine:
        losses = []
        for step in range(4):
            loss = engine.train_step(inputs, target)
            if loss is not None:
                losses.append((step, loss))
            # no rank starts a step before every rank ended the last one: without it, on a busy machine rank 0
            # began step k while rank 1 still finished step k - 1, and its first ops came out before the step's
            # start (the report's events can begin below 0 then; checked exactly by the replayed runs above)
            torch.distributed.barrier()
        save_run_report(engine, plan, out / "engine.json", batch_size=BATCH, losses=losses, plan_path="mlp.plan")


@pytest.mark.slow
def test_save_run_report_gathers_every_rank_under_torchrun(tmp_path: Path, body: dict[str, Any]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               str(tmp_path)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert json.loads((tmp_path / "rank0.json").read_text()) == {"returned": str(tmp_path / "run.json")}
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"returned": None}
    written = json.loads((tmp_path / "run.json").read_text())
    measured = written["measured"]
    assert [r["rank"] for r in measured["ranks"]] == [0, 1]
    assert {r["hostname"] for r in measured["ranks"]} == {socket.gethostname()}
    assert written["losses"] == [[1, 2.5], [2, 2.25]]
    assert written["meta"]["backend"] == "gloo" and written["meta"]["world_size"] == 2
    assert written["meta"]["hosts"] == [socket.gethostname()]
    # the ranks measured their real clock offsets (equal to within clock jitter on one machine)
    assert measured["step_times_ms"] == pytest.approx(body["measured"]["step_times_ms"], abs=0.05)
    for found, expected in zip(measured["stages"], body["measured"]["stages"]):
        assert found["compute_ms"] == pytest.approx(expected["compute_ms"], abs=1e-6)
        assert found["idle_ms"] == pytest.approx(expected["idle_ms"], abs=0.05)
    assert len(written["events"]) == len(body["events"])
    assert all(math.isclose(a[7], b[7], abs_tol=5e-5) for a, b in zip(written["events"], body["events"]))
    check_engine_report(load_run_report(tmp_path / "engine.json"))


def check_engine_report(report: Any) -> None:
    """The report of 4 real gpipe steps of 2 microbatches on 2 ranks (1 warm-up): consistent, if not predictable, times."""
    assert (report.steps, report.microbatches, report.plan_path) == (3, 2, "mlp.plan")
    assert [step for step, _ in report.losses] == [0, 1, 2, 3]
    assert report.iteration_ms == pytest.approx(sorted(report.step_times_ms)[1])
    for stage in report.measured:
        assert stage.forward_ms > 0 and stage.backward_ms > 0 and stage.step_ms > 0
        assert stage.compute_ms == pytest.approx(stage.forward_ms + stage.backward_ms)
        # busy and idle are means over the steps, so they add up to the mean step (not the median iteration_ms:
        # one step slowed by a busy machine moves the mean, not the median)
        mean_step_ms = statistics.fmean(report.step_times_ms)
        assert 0 < stage.busy_ms <= mean_step_ms and stage.busy_ms + stage.idle_ms == pytest.approx(mean_step_ms)
        assert 0 <= stage.idle_fraction < 1
    # each rank's first step measured the memory it needed: at least its stage's weights and their gradients
    assert report.memory_method == "live-tensors"
    profile = load_profile(REPO / "profiles" / "mlp.json")
    for found, (start, stop) in zip(report.measured, report.stage_layers):
        weights = sum(layer.param_bytes for layer in profile.layers[start:stop])
        assert found.peak_memory_bytes >= 2 * weights  # SGD without momentum keeps no state
    events = report.events
    counts = events.groupby(["rank", "op"]).size().to_dict()
    assert counts == {(0, "forward"): 2, (0, "backward"): 2, (0, "send_activation"): 2, (0, "step"): 1,
                      (1, "forward"): 2, (1, "backward"): 2, (1, "send_gradient"): 2, (1, "step"): 1}
    assert (events["end_s"] >= events["start_s"]).all() and events["start_s"].min() >= 0
    step_ms = max(report.step_times_ms)
    assert events["end_s"].max() * 1000.0 <= step_ms + 1.0  # a transfer may end just after its sender's step


def tied_replicated_gpt_plan(gpt: Profile) -> Plan:
    """gpt's 1f1b plan on 8 GPUs at 4 per node within 101 MB, 8 microbatches: the tied embedding on the first stage
    and the head on the last, replicated 3 times. (Within 100 MB, its stage 1 peaks 0.13 MB over in simulation and
    no plan is left within 99.87: partition refuses.)"""
    return partition(gpt, make_cluster(8, 4, ("10GB/s", "1GB/s"), memory="101MB"), schedule="1f1b", microbatches=8)


def test_a_replicated_stage_holding_a_tied_weight_measures_both_its_all_reduces_as_predicted() -> None:
    gpt = load_profile(REPO / "profiles" / "gpt.json")
    plan = tied_replicated_gpt_plan(gpt)
    tied = [index for index, stage in enumerate(plan.stages) if stage.tied_allreduce_ms > 0]
    assert tied == [0, len(plan.stages) - 1] and plan.stages[-1].replicas > 1  # the embedding and the head
    report = build_run_report(plan, replay_timeline(simulate(plan, gpt), 3), batch_size=8 * plan.microbatch_size,
                              losses=[])
    body, table = report.to_dict(), comparison_table(report)
    for index in tied:
        assert table.loc[f"stage {index} all-reduce (ms/step)", "ratio"] == pytest.approx(1.0, rel=1e-6)
        found, expected = body["measured"]["stages"][index], body["predicted"]["stages"][index]
        replica_ms = plan.stages[index].allreduce_ms if plan.stages[index].replicas > 1 else 0.0
        assert expected["allreduce_ms"] == pytest.approx(replica_ms + plan.stages[index].tied_allreduce_ms)
        assert found["allreduce_ms"] == pytest.approx(expected["allreduce_ms"], rel=1e-6)  # replicas, then tie


def entered_on_arrival(trace: RankTrace) -> RankTrace:
    """`trace` with each all-reduce starting when its rank got there (the end of its op before), as the
    runtime times a collective that waits for the other ranks; the simulator starts it at the last arrival."""
    ops = sorted(trace.ops, key=lambda op: op.start_s)
    moved, free_at = [], -math.inf
    for op in ops:
        moved.append(dataclasses.replace(op, start_s=free_at) if op.op == "allreduce" and free_at > -math.inf else op)
        if op.op in ("forward", "backward", "weight", "allreduce", "step"):
            free_at = max(free_at, op.end_s)
    return dataclasses.replace(trace, ops=tuple(moved))


def test_an_all_reduce_measures_from_its_last_rank_entering_and_the_wait_before_is_idle() -> None:
    # gpt's tied embedding and head on the first and the replicated last stage: under 1f1b the last stage
    # reaches its step long before the first, and waits in the tied all-reduce. Recorded from each rank's own
    # entry, its all-reduces read the wait too (over 10x the prediction); from the last rank's entry they
    # read what the simulator played, and the wait is idle time as in the simulation
    gpt = load_profile(REPO / "profiles" / "gpt.json")
    plan = tied_replicated_gpt_plan(gpt)
    timeline = simulate(plan, gpt)
    offsets = {rank: 1000.0 * rank - 3.7 for rank in range(8)}  # each rank's own clock
    traces = [entered_on_arrival(trace) for trace in replay_timeline(timeline, 3, clock_offsets_s=offsets)]
    last = plan.stages[-1]
    waited = [op.end_s - op.start_s for trace in traces if trace.rank in last.ranks for op in trace.ops
              if op.op == "allreduce" and op.step > 0]
    assert len(waited) == 2 * 2 * last.replicas  # per step and rank: the replicas', then the tied weights'
    assert sum(waited) > 10 * (last.allreduce_ms + last.tied_allreduce_ms) / 1000.0 * 2 * last.replicas
    body = report_body(plan, traces, batch_size=8 * plan.microbatch_size, losses=[])
    bubbles = timeline.bubble_fraction()
    for index, stage in enumerate(plan.stages):
        found, expected = body["measured"]["stages"][index], body["predicted"]["stages"][index]
        assert found["allreduce_ms"] == pytest.approx(expected["allreduce_ms"], rel=1e-6)
        assert found["idle_fraction"] == pytest.approx(float(bubbles[list(stage.ranks)].mean()), rel=1e-6)


def test_a_boundary_transfer_is_the_median_so_a_sender_thread_resuming_late_does_not_count() -> None:
    # three activations of 0.5 ms and one gradient whose sender thread resumed 40 ms after it was sent
    sends = [OpTime(1, SEND_ACTIVATION, 0, mb, 1, mb * 10.0, mb * 10.0 + 0.0005) for mb in range(3)]
    late = [OpTime(1, SEND_GRADIENT, 0, 0, 0, 50.0, 50.04)]
    ops = {(0, 1): sends, (1, 1): late}
    assert _boundary_transfer_ms(ops, [[0], [1]], [1]) == pytest.approx([0.5])


@pytest.mark.parametrize("device, processes", [("cpu", 4), ("cuda:0", None)])
def test_a_runs_conditions_count_its_machines_processes_on_a_cpu_and_none_on_gpus(
        monkeypatch: pytest.MonkeyPatch, device: str, processes: int | None) -> None:
    from runtime.report import run_meta

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert run_meta(SimpleNamespace(device=device))["conditions"]["processes"] == processes


if __name__ == "__main__":
    from runtime.worker_exit import exit_worker

    worker(Path(sys.argv[1]))
    exit_worker(0)
