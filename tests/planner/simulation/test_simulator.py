"""The simulator against hand-checked timings, and its summaries (iteration, bubbles, memory, trace)."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs.layer_arrays import LayerArrays
from planner.costs.schedule_cost import CostInputs, Stage
from planner.files.cluster import make_cluster
from planner.files.profile import load_profile
from planner.schedules.schedule import (ALLREDUCE, BACKWARD, CHUNKED_SCHEDULES, FIXED_CHUNKS, FORWARD, SCHEDULES,
                                        SEND_ACTIVATION, SENDS, build_schedule)
from planner.files.timeline import StageTimes
from planner.simulation.simulator import (SimulationTooLongError, simulate_schedule, simulate_stages,
                                          simulated_iteration_s)

GPT = Path(__file__).resolve().parents[3] / "tests" / "data" / "profiles-cpu" / "gpt.json"

F, B = 1.0, 2.0


def equal_stages(count: int, **extra: float) -> list[StageTimes]:
    """`count` stages with forward F and backward B seconds and no transfer."""
    return [StageTimes(F, B, 0.0, 0.0, **extra) for _ in range(count)]


@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_with_equal_stages_takes_m_plus_p_minus_1_times_f_plus_b(name: str, stages: int, microbatches: int) -> None:
    """GPipe and 1F1B with p equal stages and m microbatches take (m + p - 1)(f + b)."""
    timeline = simulate_schedule(build_schedule(name, [1] * stages, microbatches), equal_stages(stages))
    assert timeline.iteration_s() == pytest.approx((microbatches + stages - 1) * (F + B))


def test_a_receiver_thread_posts_two_receives_ahead_of_the_messages_that_arrived() -> None:
    """1f1b on 2 equal stages (F = 1, B = 2, instant links), 4 microbatches of 10-byte messages, 100 bytes held per
    microbatch. Rank 0 runs F0 [0, 1] F1 [1, 2] B0 [4, 6] F2 [6, 7] B1 [7, 9] F3 [9, 10] B2 [10, 12] B3 [13, 15],
    rank 1 F0 [1, 2] B0 [2, 4] F1 [4, 5] B1 [5, 7] F2 [7, 8] B2 [8, 10] F3 [10, 11] B3 [11, 13]. Rank 1's receiver
    thread posts A0 and A1 at the start, A2 when A0 arrives (1) and A3 when A1 does (2), each taken when its forward
    starts (1, 4, 7, 10); rank 0's posts G0 and G1 at the start, G2 when G0 arrives (4) and G3 when G1 does (7),
    taken by B0-B3 (4, 7, 10, 13). So rank 1 holds A1, A2 and A3 during its first backward: 100 + 3 x 10; rank 0
    holds two gradients from the start: 2 x 100 + 2 x 10 from F1 on."""
    times = [StageTimes(F, B, 0.0, 10.0, held_bytes=100.0), StageTimes(F, B, 0.0, 0.0, held_bytes=100.0)]
    timeline = simulate_schedule(build_schedule("1f1b", [1, 1], 4), times)
    rows = sorted(map(tuple, timeline.buffers.itertuples(index=False)))
    assert rows == [(0, 0, 0.0, 4.0, 10.0), (0, 0, 0.0, 7.0, 10.0), (0, 0, 4.0, 10.0, 10.0), (0, 0, 7.0, 13.0, 10.0),
                    (1, 1, 0.0, 1.0, 10.0), (1, 1, 0.0, 4.0, 10.0), (1, 1, 1.0, 7.0, 10.0), (1, 1, 2.0, 10.0, 10.0)]
    assert list(timeline.peak_memory()) == [pytest.approx(220.0), pytest.approx(130.0)]
    memory = timeline.memory()
    last = memory[memory["rank"] == 1]
    assert last[last["time_s"] == 2.0]["bytes"].iloc[-1] == pytest.approx(130.0)  # A3 posted during F0's end


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_zb_h1_with_equal_f_b_w_has_a_third_of_1f1bs_bubble(stages: int, microbatches: int) -> None:
    """With F = B = W (m >= p), zb-h1 takes m (F + B + W) + (p - 1)(F + B - W) (Qi et al.): bubble (p - 1) F,
    against 1f1b's (p - 1)(F + B + W)."""
    times = [StageTimes(F, F, 0.0, 0.0, weight_s=F) for _ in range(stages)]
    timeline = simulate_schedule(build_schedule("zb-h1", [1] * stages, microbatches), times)
    assert timeline.iteration_s() == pytest.approx(3 * microbatches * F + (stages - 1) * F)
    whole = simulate_schedule(build_schedule("1f1b", [1] * stages, microbatches), equal_stages(stages))
    assert whole.iteration_s() - 3 * microbatches * F == pytest.approx(3 * (stages - 1) * F)


def test_zb_h1_holds_a_microbatch_until_its_w() -> None:
    """Every stage of a 4-stage zb-h1 pipeline holds 4 microbatches at its peak (1f1b: 4, 3, 2, 1)."""
    times = [StageTimes(F, F, 0.0, 0.0, held_bytes=1.0, weight_s=F) for _ in range(4)]
    timeline = simulate_schedule(build_schedule("zb-h1", [1] * 4, 8), times)
    assert list(timeline.peak_memory()) == [pytest.approx(4.0)] * 4


def test_zb_h1_keeps_each_microbatchs_deferred_gradients_from_its_b_to_its_w() -> None:
    """Stage s of a 4-stage zb-h1 pipeline runs W of k after B of k + s: s + 1 microbatches' deferred
    gradients at its peak (m of them when m is fewer), on top of the 4 microbatches in flight."""
    for microbatches in (8, 3):
        times = [StageTimes(F, F, 0.0, 0.0, held_bytes=1.0, weight_s=F, deferred_bytes=100.0) for _ in range(4)]
        timeline = simulate_schedule(build_schedule("zb-h1", [1] * 4, microbatches), times)
        held = min(4, microbatches)
        assert list(timeline.peak_memory()) == [pytest.approx(held + 100.0 * min(s + 1, microbatches))
                                                for s in range(4)]


@pytest.mark.parametrize("ranks,chunks,microbatches", [(4, 1, 8), (4, 2, 8), (4, 4, 8), (4, 2, 16), (2, 3, 6), (3, 2, 3)])
def test_interleaved_1f1b_divides_the_bubble_by_the_chunks(ranks: int, chunks: int, microbatches: int) -> None:
    """A model of forward F and backward B per microbatch cut into p v equal chunks: m (F + B) + (p - 1)(F + B) / v
    (Narayanan et al. 2021), 1f1b's bubble divided by v; rank r holds the base bytes of its v chunks and, at its
    peak, min(2 (p - r - 1) + (v - 1) p + 1, m v) chunk-microbatches' activations (its warm-up forwards, plus one)."""
    times = [StageTimes(F / chunks, B / chunks, 0.0, 0.0, held_bytes=1.0, base_bytes=100.0)
             for _ in range(ranks * chunks)]
    timeline = simulate_schedule(build_schedule("interleaved-1f1b", [1] * (ranks * chunks), microbatches,
                                                chunks=chunks), times)
    assert timeline.iteration_s() == pytest.approx(microbatches * (F + B) + (ranks - 1) * (F + B) / chunks)
    peaks = timeline.memory().groupby("rank")["bytes"].max()
    assert list(peaks) == [pytest.approx(100.0 * chunks + min(2 * (ranks - r - 1) + (chunks - 1) * ranks + 1,
                                                              microbatches * chunks)) for r in range(ranks)]
    assert list(timeline.peak_memory()) == [peaks[stage % ranks] for stage in range(ranks * chunks)]


@pytest.mark.parametrize("ranks,microbatches", [(1, 1), (2, 3), (2, 8), (3, 6), (4, 7), (4, 16), (5, 9)])
def test_zbv_with_equal_f_b_w_idles_only_the_first_forwards_way_down(ranks: int, microbatches: int) -> None:
    """zbv on p ranks, 2p equal chunks of F = B = W = f, m >= 2p - 1: 6 m f of work per rank and a bubble of
    (p - 1) f, the first forward's way down to the last rank (1f1b on the same ranks: 3 (p - 1) 2 f); every
    rank holds 2p chunk-microbatches at its peak, p of a whole stage's size: 1f1b's first stage's."""
    times = [StageTimes(F, F, 0.0, 0.0, held_bytes=1.0, weight_s=F) for _ in range(2 * ranks)]
    timeline = simulate_schedule(build_schedule("zbv", [1] * (2 * ranks), microbatches, chunks=2), times)
    assert timeline.iteration_s() == pytest.approx(6 * microbatches * F + (ranks - 1) * F)
    peaks = timeline.memory().groupby("rank")["bytes"].max()
    assert list(peaks) == [pytest.approx(min(2 * ranks, 2 * microbatches))] * ranks


def test_the_turn_of_the_v_is_no_transfer() -> None:
    """zbv's stages p - 1 and p share rank p - 1: the activation and gradient between them cost nothing and
    leave as soon as they exist, while every other message pays latency + bytes / bandwidth (2.75 s, longer
    than a forward: the links stay busy)."""
    times = [StageTimes(F, F, 0.0, 2.5e9, weight_s=F) for _ in range(4)]
    timeline = simulate_schedule(build_schedule("zbv", [1] * 4, 4, chunks=2), times, make_cluster(2, None, [1e9],
                                                                                                   latencies=[0.25]))
    sends = timeline.events[timeline.events["op"].isin(SENDS)]
    turn = sends["stage"].isin([1, 2]) & (sends["peer"] == 1)
    assert turn.any() and (~turn).any()
    assert list((sends["end_s"] - sends["start_s"])[turn]) == [0.0] * int(turn.sum())
    forwards = timeline.events[(timeline.events["op"] == FORWARD) & (timeline.events["stage"] == 1)]
    ends = dict(zip(forwards["microbatch"], forwards["end_s"]))
    handed = sends[turn & (sends["op"] == SEND_ACTIVATION)]  # at once, behind no transfer to another rank
    assert list(handed["start_s"]) == [ends[mb] for mb in handed["microbatch"]]
    assert list((sends["end_s"] - sends["start_s"])[~turn]) == [pytest.approx(0.25 + 2.5)] * int((~turn).sum())


def test_iterations_repeat_the_flushed_iteration() -> None:
    """Three flushed iterations take three times one, and iteration_s reports one."""
    one = simulate_schedule(build_schedule("1f1b", [1, 1, 1], 5), equal_stages(3))
    three = simulate_schedule(build_schedule("1f1b", [1, 1, 1], 5, iterations=3), equal_stages(3))
    assert three.makespan_s == pytest.approx(3 * one.makespan_s)
    assert three.iteration_s() == pytest.approx(one.iteration_s())


def test_one_f_one_b_keeps_at_most_p_minus_s_microbatches_in_flight() -> None:
    """Stage s of a p-stage 1F1B pipeline holds at most p - s microbatches (and exactly that many at its peak)."""
    stages, microbatches, held = 4, 8, 10.0
    timeline = simulate_schedule(build_schedule("1f1b", [1] * stages, microbatches),
                                 equal_stages(stages, held_bytes=held))
    peaks = timeline.peak_memory()
    for stage in range(stages):
        assert peaks[stage] == pytest.approx((stages - stage) * held)


def test_gpipe_holds_every_microbatch() -> None:
    """GPipe keeps all m microbatches' activations at its peak, on every stage."""
    timeline = simulate_schedule(build_schedule("gpipe", [1, 1], 6), equal_stages(2, held_bytes=1.0, base_bytes=5.0))
    assert list(timeline.peak_memory()) == [pytest.approx(11.0), pytest.approx(11.0)]


def test_a_stage_replicated_twice_takes_alternate_microbatches() -> None:
    """Stage 1 on two replicas: replica 0 runs the even microbatches, replica 1 the odd, side by side."""
    times = [StageTimes(F, B, 0.0, 0.0), StageTimes(2 * F, 2 * B, 0.5, 0.0)]
    timeline = simulate_schedule(build_schedule("1f1b", [1, 2], 4), times)
    forwards = timeline.events[(timeline.events["op"] == FORWARD) & (timeline.events["stage"] == 1)]
    assert sorted(forwards.loc[forwards["replica"] == 0, "microbatch"]) == [0, 2]
    assert sorted(forwards.loc[forwards["replica"] == 1, "microbatch"]) == [1, 3]
    first_even = forwards[forwards["microbatch"] == 0]["start_s"].iloc[0]
    first_odd = forwards[forwards["microbatch"] == 1]["start_s"].iloc[0]
    assert first_odd - first_even == pytest.approx(F)  # the odd one starts as soon as stage 0 made it
    reduce = timeline.events[timeline.events["op"] == "allreduce"]
    assert len(reduce) == 2 and reduce["start_s"].nunique() == 1  # both replicas reduce together


def test_transfers_take_bytes_over_the_link_and_overlap_compute() -> None:
    """A 1e9-byte activation over 1e9 B/s takes 1 s; the sender computes on meanwhile."""
    cluster = make_cluster(2, None, [1e9])
    times = [StageTimes(F, B, 0.0, 1e9), StageTimes(F, B, 0.0, 0.0)]
    timeline = simulate_schedule(build_schedule("gpipe", [1, 1], 2), times, cluster)
    sends = timeline.events[timeline.events["op"] == SEND_ACTIVATION]
    assert list(sends["end_s"] - sends["start_s"]) == [pytest.approx(1.0)] * 2
    second_forward = timeline.events[(timeline.events["op"] == FORWARD) & (timeline.events["rank"] == 0)
                                     & (timeline.events["microbatch"] == 1)]
    assert second_forward["start_s"].iloc[0] == pytest.approx(F)  # not delayed by the first send
    receiving = timeline.events[(timeline.events["op"] == FORWARD) & (timeline.events["rank"] == 1)]
    assert receiving["start_s"].min() == pytest.approx(F + 1.0)


def test_each_transfer_pays_the_link_latency() -> None:
    """Latency 0.25 s per message: the same 1e9 bytes take 1.25 s, and the receiver starts that much later."""
    cluster = make_cluster(2, None, [1e9], latencies=[0.25])
    times = [StageTimes(F, B, 0.0, 1e9), StageTimes(F, B, 0.0, 0.0)]
    timeline = simulate_schedule(build_schedule("gpipe", [1, 1], 2), times, cluster)
    transfers = timeline.events[timeline.events["op"].isin(SENDS)]
    assert list(transfers["end_s"] - transfers["start_s"]) == [pytest.approx(1.25)] * len(transfers)
    receiving = timeline.events[(timeline.events["op"] == FORWARD) & (timeline.events["rank"] == 1)]
    assert receiving["start_s"].min() == pytest.approx(F + 1.25)


def test_the_optimizer_step_follows_the_allreduce_and_ends_the_iteration() -> None:
    times = [StageTimes(F, B, 0.5, 0.0, step_s=0.25)]
    timeline = simulate_schedule(build_schedule("gpipe", [2], 2), times)
    steps = timeline.events[timeline.events["op"] == "step"]
    reduces = timeline.events[timeline.events["op"] == ALLREDUCE]
    assert list(steps["end_s"] - steps["start_s"]) == [pytest.approx(0.25)] * 2
    assert steps["start_s"].min() == pytest.approx(reduces["end_s"].max())
    assert timeline.iteration_s() == pytest.approx(F + B + 0.5 + 0.25)  # each replica: one microbatch
    with_scratch = simulate_schedule(build_schedule("gpipe", [1], 2), [StageTimes(F, B, 0.0, 0.0, 100.0, 10.0,
                                                                                   step_s=0.25, scratch_bytes=30.0)])
    memory = with_scratch.memory()
    assert memory["bytes"].max() == pytest.approx(130.0)  # during the step: base + scratch, above base + 2 held
    assert memory["bytes"].iloc[-1] == pytest.approx(100.0)


def test_stages_holding_tied_weights_sum_their_gradients_together_before_their_steps() -> None:
    # 1f1b, 2 stages, 2 microbatches: rank 1 ends its last backward at 7, rank 0 at 9 (the flush's 3 x 3)
    times = equal_stages(2, step_s=0.25, tied_s=0.5)
    timeline = simulate_schedule(build_schedule("1f1b", [1, 1], 2), times)
    tied = timeline.events[(timeline.events["op"] == ALLREDUCE) & (timeline.events["microbatch"] == -1)]
    assert sorted(tied["rank"]) == [0, 1]
    assert list(tied["start_s"]) == pytest.approx([9.0, 9.0])  # rank 1 waits for rank 0 to get there
    assert list(tied["end_s"]) == pytest.approx([9.5, 9.5])
    steps = timeline.events[timeline.events["op"] == "step"]
    assert list(steps["start_s"]) == pytest.approx([9.5, 9.5])
    assert timeline.iteration_s() == pytest.approx(9.0 + 0.5 + 0.25)


def test_backwards_after_a_ranks_first_accumulate_gradients() -> None:
    timeline = simulate_schedule(build_schedule("gpipe", [1], 3), [StageTimes(F, B, 0.0, 0.0, accumulate_s=0.125)])
    backwards = timeline.events[timeline.events["op"] == BACKWARD].sort_values("start_s")
    assert list(backwards["end_s"] - backwards["start_s"]) == pytest.approx([B, B + 0.125, B + 0.125])
    assert timeline.iteration_s() == pytest.approx(3 * (F + B) + 2 * 0.125)


def test_pipedream_steady_state_is_the_slowest_stage() -> None:
    """Asynchronous 1F1B settles at the slowest stage's f + b per microbatch; two replicas of that
    stage take turns and halve it: stage 1 needs 2 (F + B) = 6 s per microbatch per replica, so 3 s."""
    times = [StageTimes(F / 2, B / 2, 0.0, 0.0), StageTimes(2 * F, 2 * B, 0.0, 0.0)]
    timeline = simulate_schedule(build_schedule("pipedream", [1, 1], 40), times)
    assert timeline.iteration_s() == pytest.approx(2 * (F + B))
    replicated = simulate_schedule(build_schedule("pipedream", [1, 2], 40), times)
    assert replicated.iteration_s() == pytest.approx(F + B)


@pytest.mark.parametrize("allreduce_s", [1.0, 5.0])
def test_pipedream_allreduce_overlaps_compute(allreduce_s: float) -> None:
    """pipedream all-reduces run on their own channel: two data-parallel replicas (t = F + B = 3 s
    each) finish a microbatch every max(t, a) / 2 s, and every all-reduce starts when the later
    replica's backward of the round ends, never before."""
    timeline = simulate_schedule(build_schedule("pipedream", [2], 40), [StageTimes(F, B, allreduce_s, 0.0)])
    assert timeline.iteration_s() == pytest.approx(max(F + B, allreduce_s) / 2)
    events = timeline.events
    backward_ends = events[events["op"] == BACKWARD].groupby(["rank"])["end_s"].apply(sorted)
    for rank, starts in events[events["op"] == ALLREDUCE].groupby("rank")["start_s"]:
        rounds = zip(backward_ends[0], backward_ends[1])
        assert all(start >= max(pair) - 1e-12 for start, pair in zip(sorted(starts), rounds))


def test_bubble_fraction_of_gpipe() -> None:
    """With p equal stages and m microbatches each rank idles (p - 1) / (m + p - 1) of the time."""
    timeline = simulate_schedule(build_schedule("gpipe", [1] * 4, 8), equal_stages(4))
    assert list(timeline.bubble_fraction()) == [pytest.approx(3 / 11)] * 4


def test_trace_has_one_event_per_op(tmp_path) -> None:
    """The Chrome trace is valid JSON with one complete event per simulated op, times in microseconds."""
    timeline = simulate_schedule(build_schedule("1f1b", [1, 2, 1], 4), equal_stages(3), make_cluster(4, None, [1e9]))
    path = tmp_path / "trace.json"
    timeline.write_trace(str(path))
    trace = json.loads(path.read_text())
    complete = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    assert len(complete) == len(timeline.events)
    backward = next(e for e in complete if e["cat"] == BACKWARD)
    assert backward["dur"] == pytest.approx(B * 1e6)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SCHEDULES), st.sampled_from((1, 2, 4)), st.integers(1, 6), st.data())
def test_the_iteration_alone_is_the_timelines(schedule: str, ranks: int, microbatches: int,
                                              data: st.DataObject) -> None:
    """`simulated_iteration_s`, which skips the timeline, states what `simulate_stages(...).iteration_s()` does, for
    every schedule on a profile with transfers across two nodes, stages cut and replicated at random."""
    arrays = LayerArrays.from_profile(load_profile(GPT)).for_schedule(schedule)
    chunks = FIXED_CHUNKS.get(schedule, 2) if schedule in CHUNKED_SCHEDULES else 1
    if schedule == "interleaved-1f1b":
        microbatches = ranks * data.draw(st.integers(1, 2))
    count = ranks * chunks if chunks > 1 else data.draw(st.integers(1, ranks))
    cuts = sorted(data.draw(st.sets(st.integers(1, arrays.num_layers - 1), min_size=count - 1, max_size=count - 1)))
    edges = [0, *cuts, arrays.num_layers]
    replicas = [1] * count
    if chunks == 1:
        for _ in range(ranks - count):
            replicas[data.draw(st.integers(0, count - 1))] += 1
    stages = [Stage(a, b, r, data.draw(st.booleans())) for a, b, r in zip(edges, edges[1:], replicas)]
    inputs = CostInputs(arrays, make_cluster(ranks, 2 if ranks > 2 else None, ["100GB/s", "10GB/s"]), schedule,
                        microbatches, chunks=chunks, step_s_per_byte=1e-12)
    try:
        expected = simulate_stages(inputs, stages).iteration_s()
    except SimulationTooLongError:
        return
    assert simulated_iteration_s(inputs, stages) == expected
