"""The planner's cost model: a plan's iteration time and memory per schedule (pure functions, no I/O).

All times are seconds, all sizes bytes. A plan is a list of stages `(start, stop, replicas,
recompute)` over the profile's layers; a stage with r replicas takes every r-th microbatch
(round-robin). `CostInputs` carries everything else.

Scaling. The profile was measured at batch size b; a microbatch of u samples scales every
time, cut and activation by sigma = u / b (linear; weights do not scale). Linear scaling is
optimistic for microbatches much smaller than b on a GPU (fixed per-kernel costs), which is why
microbatches default to the profiled batch size.

Ranks. Stages occupy contiguous rank blocks; the plan's last stage ends on the cluster's last
rank and the blocks run backwards from there, then the whole plan is shifted down by the
largest multiple of M (the size of the second-outermost group, 1 for a flat cluster) that keeps
it on the cluster. Shifting by M changes no bandwidth, so a flat plan uses ranks 0..U-1.
Placement rule: at every level but the outermost, a stage's ranks lie inside one group or are
whole groups (a stage never straddles part of a node). With it, the slowest link between two
adjacent stages' devices is the link between the last rank of one and the first of the next.

For stage s = layers [i, j) with r replicas on ranks [p, p + r), recompute q in {0, 1}:

    F = sigma sum fwd,  B = sigma sum bwd,  t = F + B + q F       (one microbatch, one device)
    c_in  = lat(p-1, p) + sigma cut_bytes[i-1] / bw(p-1, p)          (0 for the first stage)
    c_out = lat(p+r-1, p+r) + sigma cut_bytes[j-1] / bw(p+r-1, p+r)  (0 for the last stage)
    ar = 2 (r - 1) (W' / (r bw) + lat), bw and lat of the span p..p+r-1
                                 (ring all-reduce of the stage's weights W' but those tied to other
                                 stages, which `tied_allreduce_s` sums: 2 (r - 1) messages of W' / r)

bw and lat are the cluster's bandwidth (bytes/s) and latency (s per message) of the innermost
level holding both ranks (`link_bandwidth`, `link_latency`); in ar, that level's all-reduce terms where
the cluster file has them (measured by `planner cluster`; `allreduce_terms`).

Transfers run on their own channel (one per direction), overlapped with compute.

- Flush schedules (`gpipe`, `1f1b`), m microbatches, one all-reduce per iteration:
      Q(s) = (ceil(m / r) - 1) max(t + acc, c_in, c_out) + ar(s) + opt(s)
      iteration = sum_s t(s) + max_s Q(s)
  with opt = W x the optimizer step's time per weight byte + n x its time per parameter tensor (n:
  the stage's parameter tensors; both rates measured by the profiler) and acc = W x the time per byte of
  adding a microbatch's gradients into the accumulated ones (both measured by the profiler; every
  backward after a replica's first accumulates).
  The sum is one microbatch's trip through every stage and back (fill and drain with unequal
  stages: sum_s t = sigma T_total + recomputed forwards); the busiest replica then handles its
  ceil(m / r) - 1 other microbatches and the all-reduce. For equal stages and no communication
  this is GPipe's and 1F1B's (m + S - 1)(f + b); for one stage on r replicas it is data
  parallelism's ceil(m / r) t + ar. Transfers during fill and drain (latency included) are not counted,
  nor is the all-reduce of tied weights across stages (`tied_allreduce_s`); the simulator plays both.
- `zb-h1` (flush; each backward split into B and W, `schedules.schedule`): W(s) = sigma x the stage's
  layers' weight-gradient times (`LayerArrays.weight_s`); a microbatch's trip leaves the W's out:
      iteration = sum_s (t(s) - W(s)) + max_s [Q(s) + W(s)]
  with Q as for the flush schedules (and no recompute). It does not credit the W's that fill the
  drain (the simulator does); on equal stages it reads (p - 1)(F + B) for the bubble, against
  the schedule's (p - 1)(F + B - W) and 1f1b's (p - 1)(F + B + W). Backwards split cost f times
  their whole time (`LayerArrays.for_schedule`), but a first stage's: it has no input gradient to
  compute and runs its backward whole (`first_terms`; its B and W keep their shares of it).
- `pipedream` (asynchronous 1F1B, weight stashing, an all-reduce after every microbatch):
      Q(s) = max(t + ar + opt, c_in, c_out) / r,    time per microbatch = max_s Q(s)

Memory per device of a stage with weights W, k optimizer state copies (Adam 2, SGD 1),
activations a = sigma saved_bytes per microbatch (the stage's layers' less what its first layer saves of its
inputs, `LayerArrays.pair_saved_bytes`, plus the inputs it received, or on a first stage its microbatch of the
batch, `received_terms`; q = 1: a = sigma bytes entering the stage, plus one microbatch's sigma saved_bytes
rebuilt during its backward) and n microbatches in
flight per replica (`schedules.schedule.in_flight`), D = devices of this stage and every later one:

    gpipe: n = ceil(m / r)     1f1b: n = min(ceil(m / r), ceil(D / r))     pipedream: n = ceil(D / r)
    zb-h1: n = min(ceil(m / r), ceil(D / r) + ceil((P - D) / r)), P the cluster's devices (a microbatch
           is held until its W; the W's of later stages trail further, `schedule.weight_deferral`)
    memory = W (2 + k) + F + max(n a + q sigma saved + w + ahead, s W)  (+ (n - 1) W stashed weight versions for
           pipedream; ahead: the receive buffers allocated ahead, min(3, ceil(m / r) - n) activations entering
           (zb-h1: min(2, ...)) and min(2, ceil(m / r) - 1) gradients, `ahead_terms`)
           (zb-h1: w becomes (c - 1) g + max(b, g + v), c = min(d + 1, ceil(m / r)), g = sigma deferred_bytes of
           the stage's layers, the gradients a microbatch keeps from its B to its W, 0 on the first stage;
           d = ceil((P - D) / r); b what its B holds: at a layer what it holds there with what the layers after
           it keep, v the largest weight gradient its W makes, `backward_top_terms`; a recomputing stage
           c g + q sigma saved + w)
    with s W the optimizer step's scratch memory (s per parameter byte, measured in the profile; on CPU s' X
    instead, X the stage's largest parameter tensor, `CostInputs.scratch_per_largest`), or on a stage of r > 1
    replicas the all-reduce's buffer where that is more: the runtime copies the gradients of its replicated bytes
    into one buffer, besides the gradients, once the activations are gone, and of a tied weight (one per tie, at the
    step) likewise: R, the larger (`reduce_terms`), and
    w = sigma max over the stage's layers of workspace_bytes: what a layer's backward holds beyond
    the saved activations (gradients between layers, temporaries such as a loss's gradient over a
    vocabulary; measured in the profile, 0 in older ones)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

import numpy as np

from planner.files.cluster import Cluster
from planner.files.timeline import RECEIVES_AHEAD
from planner.costs.layer_arrays import LayerArrays
from planner.schedules.schedule import (
    SPLIT_BACKWARD_SCHEDULES, ArrayOrInt, in_flight, stage_placement, weight_deferral,
)

ArrayOrFloat = Union[float, np.ndarray]
ArrayOrBool = Union[bool, np.ndarray]


class Stage(NamedTuple):
    """One stage of a plan: layers [start, stop) on `replicas` devices, recomputing its activations or not.
    Plain (start, stop, replicas, recompute) tuples are accepted wherever a Stage is."""

    start: int
    stop: int
    replicas: int
    recompute: bool


def replicas_of(stages: Sequence[Stage]) -> list[int]:
    """Each stage's replica count, in order."""
    return [replicas for _, _, replicas, _ in stages]


@dataclass(frozen=True)
class CostInputs:
    """What the cost model needs besides the plan: layers, cluster, schedule and limits.

    `scale`: microbatch size / profiled batch size; `input_bytes`: the model input per profiled
    batch (what a recomputing first stage keeps); `memory_bytes`: per device, or None;
    `library_bytes`: what every device holds beyond tensors (`Profile.library_bytes`: CUDA libraries'
    workspaces), once per device.
    """

    arrays: LayerArrays
    cluster: Cluster
    schedule: str
    microbatches: int
    scale: float = 1.0
    input_bytes: float = 0.0
    optimizer_copies: int = 2
    memory_bytes: float | None = None
    step_s_per_byte: float = 0.0  # one optimizer step, seconds per parameter byte (0: not counted)
    scratch_per_byte: float = 0.0  # the optimizer step's scratch memory per parameter byte (0: not counted)
    accumulate_s_per_byte: float = 0.0  # adding a microbatch's gradients into .grad, seconds per byte
    step_s_per_tensor: float = 0.0  # one optimizer step, seconds per parameter tensor (on top of per byte)
    step_s_per_call: float = 0.0  # one optimizer step, seconds per call: once per stage that has a tensor to step
    chunks: int = 1  # stages per rank: v under a chunked schedule (`stage_placement`), else 1
    library_bytes: float = 0.0  # L: held by every device beyond tensors, bytes
    scratch_per_largest: float = 0.0  # the step's scratch per byte of a stage's largest parameter (0: per byte)

    @property
    def class_size(self) -> int:
        """M: size of the second-outermost group (1 for a flat cluster); plans shift by multiples of it."""
        sizes = self.cluster.group_sizes()
        return sizes[-2] if len(sizes) >= 2 else 1


def link_bandwidth(cluster: Cluster, rank_a: ArrayOrInt, rank_b: ArrayOrInt) -> np.ndarray:
    """Bandwidth between ranks (the innermost level holding both; rank_a <= rank_b), bytes/s.

    Works element-wise on arrays of ranks; a 0-d array for two ints.
    """
    return _link_value(cluster, rank_a, rank_b, [level.bandwidth_Bps for level in cluster.levels])


def link_latency(cluster: Cluster, rank_a: ArrayOrInt, rank_b: ArrayOrInt) -> np.ndarray:
    """Latency per message between ranks (as `link_bandwidth`), seconds."""
    return _link_value(cluster, rank_a, rank_b, [level.latency_s for level in cluster.levels])


def _link_value(cluster: Cluster, rank_a: ArrayOrInt, rank_b: ArrayOrInt, values: list[float]) -> np.ndarray:
    """values[level] of the innermost level holding both ranks, element-wise."""
    sizes = cluster.group_sizes()
    if isinstance(rank_a, (int, np.integer)) and isinstance(rank_b, (int, np.integer)):
        # two ranks (a stage of the simulator or of a reference cost): the first level from the inside, without
        # arrays (a fifth of the brute-force optimizer test's time went to building them)
        held = (value for group, value in zip(sizes[:-1], values[:-1]) if rank_a // group == rank_b // group)
        return np.asarray(next(held, values[-1]))
    result = np.full(np.shape(rank_a), values[-1])
    for group, value in zip(sizes[-2::-1], values[-2::-1]):
        result = np.where(np.floor_divide(rank_a, group) == np.floor_divide(rank_b, group), value, result)
    return result


def link_terms(cluster: Cluster, rank_a: ArrayOrInt, rank_b: ArrayOrInt) -> tuple[np.ndarray, np.ndarray]:
    """(bandwidth, latency) between ranks (`link_bandwidth`, `link_latency`)."""
    return link_bandwidth(cluster, rank_a, rank_b), link_latency(cluster, rank_a, rank_b)


def allreduce_terms(cluster: Cluster, first_rank: ArrayOrInt, last_rank: ArrayOrInt) -> tuple[np.ndarray, np.ndarray]:
    """(bandwidth, latency) to price an all-reduce over ranks [first, last] at (`allreduce_s`): the innermost
    level holding them all, its measured all-reduce terms (`Level.reduce_bandwidth_Bps`), else its link's."""
    return (_link_value(cluster, first_rank, last_rank, [level.reduce_bandwidth_Bps for level in cluster.levels]),
            _link_value(cluster, first_rank, last_rank, [level.reduce_latency_s for level in cluster.levels]))


def placement_ok(cluster: Cluster, first_rank: ArrayOrInt, replicas: ArrayOrInt) -> np.ndarray:
    """The placement rule: below the outermost level, the ranks lie in one group or are whole groups.

    Works element-wise on arrays; a 0-d bool array for two ints.
    """
    if isinstance(first_rank, (int, np.integer)) and isinstance(replicas, (int, np.integer)):
        # two ints (every plan a brute force or a reference cost checks): without arrays, as `_link_value`
        end = first_rank + replicas - 1
        return np.asarray(all(first_rank // group == end // group or (first_rank % group == 0 and replicas % group == 0)
                              for group in cluster.group_sizes()[:-1]))
    last = np.add(first_rank, replicas) - 1
    ok = np.full(np.shape(first_rank), True)
    for group in cluster.group_sizes()[:-1]:
        inside = np.floor_divide(first_rank, group) == np.floor_divide(last, group)
        whole = (np.remainder(first_rank, group) == 0) & (np.remainder(replicas, group) == 0)
        ok = ok & (inside | whole)
    return ok


def first_ranks(inputs: CostInputs, stages: list[Stage]) -> list[int]:
    """First rank of each stage under the placement of the module docstring (right-aligned, shifted);
    under a chunked schedule (inputs.chunks > 1) its `stage_placement`."""
    if inputs.chunks > 1:
        return list(stage_placement(inputs.schedule, len(stages), inputs.chunks))
    devices = inputs.cluster.num_devices
    used = sum(replicas_of(stages))
    shift = max(devices - used, 0) // inputs.class_size * inputs.class_size
    ranks, end = [], devices - shift
    for _, _, replicas, _ in reversed(stages):
        end -= replicas
        ranks.append(end)
    return ranks[::-1]


# --- the stage formulas of the module docstring, element-wise: the reference below, the optimizer's evaluator
# and the dynamic program's bounds all compute a stage's terms with these three functions


def transfer_s(nbytes: ArrayOrFloat, bandwidth_Bps: ArrayOrFloat, latency_s: ArrayOrFloat = 0.0,
               exists: ArrayOrBool = True) -> ArrayOrFloat:
    """One message of `nbytes` over a link: latency_s + nbytes / bandwidth_Bps seconds where the
    boundary `exists` (a stage has a neighbour on that side), 0 where it does not."""
    return np.where(exists, latency_s + nbytes / bandwidth_Bps, 0.0)


def allreduce_s(weight_bytes: ArrayOrFloat, replicas: ArrayOrInt, bandwidth_Bps: ArrayOrFloat,
                latency_s: ArrayOrFloat = 0.0) -> ArrayOrFloat:
    """ar = 2 (r - 1) (W / (r bw) + lat): a ring all-reduce of W bytes over r replicas, 2 (r - 1)
    messages of W / r each, seconds (0 for r = 1)."""
    r = np.asarray(replicas, dtype=float)
    return 2.0 * (r - 1.0) * (weight_bytes / (r * bandwidth_Bps) + latency_s)


def time_terms(schedule: str, microbatches: int, replicas: ArrayOrInt, compute_s: ArrayOrFloat,
               comm_in_s: ArrayOrFloat, comm_out_s: ArrayOrFloat, allreduce: ArrayOrFloat,
               step: ArrayOrFloat = 0.0, accumulate: ArrayOrFloat = 0.0,
               weight: ArrayOrFloat = 0.0) -> tuple[ArrayOrFloat, ArrayOrFloat]:
    """(period, Q) in seconds, with `step` the optimizer step (`step_terms`) and `accumulate` adding
    one microbatch's gradients into the stage's (`accumulate_terms`). Flush schedules: period =
    max(t + acc, c_in, c_out) / r and Q = (ceil(m / r) - 1) max(t + acc, c_in, c_out) + ar + step
    (a replica's microbatches after its first also accumulate), plus `weight` (W) for zero-bubble
    schedules, whose round trip `fill_drain_s` leaves the W's out; pipedream (a step per microbatch,
    nothing to accumulate): period = Q = max(t + ar + step, c_in, c_out) / r."""
    r = np.asarray(replicas, dtype=float)
    if schedule == "pipedream":
        period = np.maximum(np.maximum(compute_s + allreduce + step, comm_in_s), comm_out_s) / r
        return period, period
    busy = np.maximum(np.maximum(compute_s + accumulate, comm_in_s), comm_out_s)
    turns = -(-microbatches // np.asarray(replicas)) - 1
    return busy / r, turns * busy + allreduce + step + weight


def accumulate_terms(inputs: CostInputs, weight_bytes: ArrayOrFloat) -> ArrayOrFloat:
    """acc = W x the profile's gradient accumulation time per byte: what a backward after a
    replica's first in an iteration adds to t, seconds (flush schedules; 0 for pipedream)."""
    rate = 0.0 if inputs.schedule == "pipedream" else inputs.accumulate_s_per_byte
    return rate * weight_bytes


def step_terms(inputs: CostInputs, weight_bytes: ArrayOrFloat, tensors: ArrayOrFloat) -> ArrayOrFloat:
    """opt = W x the optimizer step's time per parameter byte + n x its time per parameter tensor + its time per
    call / v where n > 0: one optimizer step over the stage's W bytes in n tensors (shared copies included),
    seconds. A rank steps its v chunks (`CostInputs.chunks`) in one call, so each chunk pays 1/v of it."""
    call = inputs.step_s_per_call / inputs.chunks
    per_call = np.where(tensors > 0, call, 0.0) if isinstance(tensors, np.ndarray) else call if tensors > 0 else 0.0
    return inputs.step_s_per_byte * weight_bytes + inputs.step_s_per_tensor * tensors + per_call


def memory_terms(inputs: CostInputs, replicas: ArrayOrInt, devices_from_here: ArrayOrInt, weight_bytes: ArrayOrFloat,
                 saved_bytes: ArrayOrFloat, entering_bytes: ArrayOrFloat, recompute: ArrayOrBool,
                 workspace_bytes: ArrayOrFloat, deferred_bytes: ArrayOrFloat = 0.0, frozen_bytes: ArrayOrFloat = 0.0,
                 backward_top_bytes: ArrayOrFloat | None = None, weight_top_bytes: ArrayOrFloat = 0.0,
                 received_bytes: ArrayOrFloat = 0.0, largest_bytes: ArrayOrFloat = 0.0,
                 cut_in_bytes: ArrayOrFloat = 0.0, cut_out_bytes: ArrayOrFloat = 0.0,
                 reduce_bytes: ArrayOrFloat = 0.0,
                 ) -> tuple[ArrayOrFloat, ArrayOrFloat, ArrayOrFloat, ArrayOrFloat, ArrayOrFloat]:
    """(base, held, rebuilt, scratch, memory) bytes per device: base = W (2 + k) + F (W: the weights that need
    a gradient; F: `frozen_bytes`, those that need none, which have no gradient or optimizer state), held = a per
    microbatch in flight (its saved activations, `LayerArrays.pair_saved_bytes`, and `received_bytes`,
    `received_terms`; the bytes entering the stage when recomputing), rebuilt = what a backward holds on top:
    w (the most any of the stage's layers holds beyond saved activations) plus a when it recomputes,
    scratch = max(s W + s' X, R): what the device holds beyond base once the activations are gone, while the
    optimizer steps (s: the profile's scratch bytes per parameter byte, s' per byte of X, the stage's largest
    parameter, `largest_bytes`; one of them 0, `per_weight_byte`) or before, while a replicated stage's
    gradients are all-reduced (R = `reduce_bytes`, `reduce_terms`; under pipedream, which all-reduces after every
    microbatch while others hold activations, a lower estimate),
    memory = L + base + max(n held + rebuilt + ahead, scratch) with n = `in_flight` and ahead the receive
    buffers allocated ahead (`ahead_terms`, from `cut_in_bytes` and `cut_out_bytes`, scaled, 0 where the stage
    receives none) (the step runs when the activations are gone; L = `inputs.library_bytes`, the device's own, is in
    memory alone: a device holding several stages holds it once); pipedream keeps n weight versions (base - W,
    held + W). `saved_bytes`, `entering_bytes` and `workspace_bytes` are already scaled by sigma.
    zb-h1's in-flight count grows with the devices before the stage too: it is counted as if the plan used
    every device of the cluster (exact for such plans, an upper bound for plans on fewer), so that a
    stage's memory depends only on the stages after it, as the optimizer builds plans. Under zb-h1 a
    microbatch between its B and its W also keeps `deferred_bytes` (g, the gradients W starts from; 0 for a
    first stage): right after the B of microbatch k + d, the c = min(d + 1, ceil(m / r)) microbatches k .. k + d
    keep theirs (d = `weight_deferral`), during it c - 1 of them and the B its own b (`backward_top_bytes`,
    `backward_top_terms`; None: w + g, the most it can be), and a W its own g and v, the weight gradient it adds
    into `.grad` (`weight_top_bytes`, not scaled with the batch), so memory = L + base + max(n held + (c - 1) g +
    max(b, g + v) + ahead, scratch); a recomputing stage's W reads what its B rebuilt: n held + c g + rebuilt
    (`activation_top`). `deferred_bytes` and `backward_top_bytes` are already scaled by sigma."""
    total = inputs.cluster.num_devices
    flights = in_flight(inputs.schedule, inputs.microbatches, replicas, devices_from_here, total)
    base = weight_bytes * (2 + inputs.optimizer_copies) + frozen_bytes
    held = np.where(recompute, entering_bytes, saved_bytes + received_bytes)
    if inputs.schedule == "pipedream":  # n in flight keep n weight versions: n - 1 stashed
        base, held = base - weight_bytes, held + weight_bytes
    rebuilt = np.where(recompute, saved_bytes, 0.0) + workspace_bytes
    scratch = np.maximum(inputs.scratch_per_byte * weight_bytes + inputs.scratch_per_largest * largest_bytes,
                         reduce_bytes)
    top = activation_top(deferred_count(inputs, replicas, devices_from_here), deferred_bytes, rebuilt, recompute,
                         workspace_bytes + deferred_bytes if backward_top_bytes is None else backward_top_bytes,
                         weight_top_bytes)
    ahead = ahead_terms(inputs, replicas, flights, cut_in_bytes, cut_out_bytes)
    memory = inputs.library_bytes + base + np.maximum(flights * held + top + ahead, scratch)
    return base, held, rebuilt, scratch, memory


def reduce_terms(replicas: ArrayOrInt, replicated_bytes: ArrayOrFloat, tied_bytes: ArrayOrFloat = 0.0) -> ArrayOrFloat:
    """R, bytes: what a stage's all-reduces hold besides its gradients, one after the other once its activations are
    gone (`runtime.gradients.all_reduce_gradients` copies the gradients into one buffer, whose slices then become
    them): its replicated bytes where it has r > 1 replicas (0 for one), or its largest tied weight all-reduced
    across stages before the step (`LayerArrays.pair_tied_bytes`, each tie through a buffer of its own) where that
    is more. Element-wise."""
    return np.maximum(np.where(np.asarray(replicas) > 1, replicated_bytes, 0.0), tied_bytes)


def ahead_terms(inputs: CostInputs, replicas: ArrayOrInt, flights: ArrayOrInt, cut_in_bytes: ArrayOrFloat,
                cut_out_bytes: ArrayOrFloat) -> ArrayOrFloat:
    """Receive buffers a stage holds at its peak beyond its in-flight microbatches, bytes: a receiver thread
    (`runtime.p2p`) keeps `RECEIVES_AHEAD` = 2 receives posted ahead of the messages that arrived, each into a
    buffer allocated when it is posted. At a stage's first backward, with n (`flights`) of its M = ceil(m / r)
    microbatches taken in, it holds a_in = min(3, M - n) activations (the one the stage before sent with its
    extra forward, and two posted; none under gpipe, which took all M) of `cut_in_bytes` each and
    a_out = min(2, M - 1) gradients (two posted past the one its backward took) of `cut_out_bytes` each:
    ahead = a_in c_in + a_out c_out; under zb-h1, whose n counts the microbatches waiting for their W too,
    a_in = min(2, M - n). Exact for 1f1b and gpipe where the stages take equal times and one device each (the
    simulator plays the thread: `simulator.receive_buffers`). It counts one sending rank each way and each
    message taken as it arrives: a replica fed by several replicas (a receiver thread each, two posted each)
    or slower than its neighbour (the thread posts again once the oldest arrives, taken or not) holds more, which
    only the simulation counts (zb-h1's first stage, whose backward is whole while the next stage's B is not:
    one more on equal stages); a plan states the simulated peak where it is the larger
    (`partition._simulated_peaks`). Both count the third activation for the whole first backward, which
    arrives during it; where that backward's own peak comes first, the run holds one fewer (resnet's and a
    GPT-2's last stages under 1f1b measured two, not three). Element-wise."""
    per_replica = -(-inputs.microbatches // replicas)
    split = inputs.schedule in SPLIT_BACKWARD_SCHEDULES
    taken_in = np.minimum(RECEIVES_AHEAD + (0 if split else 1), np.maximum(per_replica - flights, 0))
    taken_out = np.minimum(RECEIVES_AHEAD, np.maximum(per_replica - 1, 0))
    return taken_in * cut_in_bytes + taken_out * cut_out_bytes


def activation_top(count: ArrayOrInt, deferred_bytes: ArrayOrFloat, rebuilt: ArrayOrFloat, recompute: ArrayOrBool,
                   backward_top: ArrayOrFloat, weight_top: ArrayOrFloat = 0.0) -> ArrayOrFloat:
    """What a stage holds at its peak on top of its in-flight microbatches' activations, bytes, with c = `count`
    microbatches' kept gradients g at most (zero-bubble schedules; c = 0 elsewhere, where b is the workspace):
    (c - 1) g + max(b, g + v) where c >= 1 (during a B, c - 1 microbatches wait for their W while the B holds b;
    during a W, c - 1 wait while it holds its own g and v), b = `backward_top`, v = `weight_top`; a recomputing
    stage's W reads the activations its B rebuilt: c g + rebuilt. Non-decreasing in c."""
    waiting = np.maximum(count - 1, 0) * deferred_bytes
    kept = waiting + np.maximum(backward_top, np.minimum(count, 1) * (deferred_bytes + weight_top))
    return np.where(recompute, count * deferred_bytes + rebuilt, kept)


def received_terms(inputs: CostInputs, starts: ArrayOrInt, entering_bytes: ArrayOrFloat) -> ArrayOrFloat:
    """What a stage keeps per microbatch in flight beyond the activations its layers make, bytes (scaled): where it
    receives (start > 0), the received inputs, `entering_bytes`: the runtime keeps them until the microbatch's
    backward has their gradients and runs the stage on them, so what its first layer saves of them is these
    (`LayerArrays.pair_saved_bytes` leaves that out); on a first stage, its microbatch of the batch, which the
    runtime copies to the device and keeps until the backward (`entering_bytes`, sigma `input_bytes`), or what its
    first layer saves of the batch (sigma `input_saved_bytes[0]`) where that is more (a `CostInputs` without
    `input_bytes`). Element-wise. (Until the runtime ran stages on clones of what they received,
    resnet's last stage from layer2.1 under zb-h1 held both, 2 x 0.26 MB per microbatch.)"""
    first = np.maximum(entering_bytes, inputs.scale * float(inputs.arrays.input_saved_bytes[0]))
    found = np.where(np.asarray(starts) > 0, entering_bytes, first)
    return found if np.ndim(found) else float(found)


def deferred_count(inputs: CostInputs, replicas: ArrayOrInt, devices_from_here: ArrayOrInt) -> ArrayOrInt:
    """How many microbatches' deferred gradients a replica keeps at once (`memory_terms`): under zb-h1
    min(d + 1, ceil(m / r)), d = `weight_deferral` with the cluster's devices as every stage's; 0 under the
    schedules that do not split the backward."""
    if inputs.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return np.zeros(np.shape(replicas), dtype=np.int64) if np.ndim(replicas) else 0
    deferral = weight_deferral(replicas, devices_from_here, inputs.cluster.num_devices)
    return np.minimum(deferral + 1, -(-inputs.microbatches // replicas))


@dataclass(frozen=True)
class StageCost:
    """One stage's terms (seconds, bytes), as in the module docstring."""

    fwd_s: float
    compute_s: float  # t: forward + backward (+ recomputed forward) of one microbatch
    comm_in_s: float
    comm_out_s: float
    allreduce_s: float
    period_s: float  # steady-state time per microbatch: max(t, c_in, c_out) / r (flush), Q (pipedream)
    bound_s: float  # Q(s): what the plan's max is taken over
    memory_bytes: float  # L + base_bytes + max(in_flight * held_bytes + top + ahead, scratch_bytes) (`memory_terms`)
    base_bytes: float = 0.0  # weights, gradients, optimizer state (pipedream: less one stashed version)
    held_bytes: float = 0.0  # per microbatch in flight: activations or stage input (+ a weight version)
    rebuilt_bytes: float = 0.0  # held during a backward on top: its workspace (+ activations rebuilt when recomputing)
    step_s: float = 0.0  # opt: one optimizer step over the stage's weights
    scratch_bytes: float = 0.0  # held by the optimizer step beyond weights, gradients and state
    accumulate_s: float = 0.0  # acc: added to each backward after a replica's first in an iteration
    tied_s: float = 0.0  # the all-reduce of tied weights across stages before the step (`tied_allreduce_s`)
    weight_s: float = 0.0  # zero-bubble schedules: W, the part of t - fwd_s that computes weight gradients
    deferred_bytes: float = 0.0  # zero-bubble schedules: kept per microbatch from its B to its W (`memory_terms`)
    backward_top_bytes: float = 0.0  # b: held by a backward (a zero-bubble B) beyond activations (`backward_top_terms`)
    weight_top_bytes: float = 0.0  # v: held by a zero-bubble W beyond the gradients it starts from (the same)


def stage_cost(
    inputs: CostInputs, start: int, stop: int, replicas: int, recompute: bool, first_rank: int,
    devices_from_here: int, neighbours: tuple[int, int] | None = None,
) -> StageCost:
    """The terms of stage [start, stop) with `replicas` on ranks [first_rank, first_rank + replicas);
    `neighbours`: the ranks of the stages before and after it (default: the adjacent ones)."""
    arrays, cluster, sigma = inputs.arrays, inputs.cluster, inputs.scale
    fwd = sigma * float(arrays.fwd_s[stop] - arrays.fwd_s[start])
    both = float(both_terms(inputs, start, stop))
    compute = both + (fwd if recompute else 0.0)
    last_rank = first_rank + replicas - 1
    before, after = neighbours if neighbours is not None else (first_rank - 1, last_rank + 1)
    comm_in = float(transfer_s(sigma * arrays.cut_before(start),
                               *link_terms(cluster, min(before, first_rank), max(before, first_rank)),
                               exists=start > 0 and before != first_rank))  # one rank's two stages: no message
    comm_out = float(transfer_s(sigma * arrays.cut_after(stop),
                                *link_terms(cluster, min(last_rank, after), max(last_rank, after)),
                                exists=stop < arrays.num_layers and after != last_rank))
    weights = arrays.stage_weight_bytes(start, stop)
    weight = float(weight_terms(inputs, start, stop))
    replicated = arrays.stage_replicated_bytes(start, stop)
    allreduce = float(allreduce_s(replicated, replicas,
                                  *allreduce_terms(cluster, first_rank, last_rank)))
    step = float(step_terms(inputs, weights, arrays.stage_tensor_count(start, stop)))
    accumulate = float(accumulate_terms(inputs, weights))
    period, bound = (float(value) for value in time_terms(inputs.schedule, inputs.microbatches, replicas, compute,
                                                           comm_in, comm_out, allreduce, step, accumulate, weight))
    saved = sigma * float(arrays.pair_saved_bytes(np.array([start]), np.array([stop]))[0])
    entering = sigma * (inputs.input_bytes if start == 0 else arrays.cut_before(start))
    cut_in, cut_out = sigma * arrays.cut_before(start), sigma * arrays.cut_after(stop)
    workspace = sigma * arrays.stage_workspace_bytes(start, stop)
    deferred = float(deferred_terms(inputs, start, stop))
    largest = float(arrays.largest_param_in(np.array([start]), np.array([stop]))[0])
    top, weight_top = (float(value) for value in backward_top_terms(inputs, start, stop, workspace))
    base, held, rebuilt, scratch, memory = (float(value) for value in memory_terms(
        inputs, replicas, devices_from_here, weights, saved, entering, recompute, workspace, deferred,
        arrays.stage_frozen_bytes(start, stop), top, weight_top, received_terms(inputs, start, entering), largest,
        cut_in, cut_out, reduce_terms(replicas, replicated, float(arrays.pair_tied_bytes(np.array([start]),
                                                                                           np.array([stop]))[0]))))
    return StageCost(fwd, compute, comm_in, comm_out, allreduce, period, bound, memory, base, held, rebuilt, step,
                     scratch, accumulate, weight_s=weight, deferred_bytes=deferred, backward_top_bytes=top,
                     weight_top_bytes=weight_top)


def both_terms(inputs: CostInputs, starts: ArrayOrInt, stops: ArrayOrInt) -> ArrayOrFloat:
    """Forward + backward of stages [start, stop) without recompute, seconds per microbatch: sigma (compute_s[stop]
    - compute_s[start]); under a zero-bubble schedule a first stage's backward is unsplit (`first_terms`).
    Element-wise."""
    arrays = inputs.arrays
    both = inputs.scale * (arrays.compute_s[stops] - arrays.compute_s[starts])
    return first_terms(inputs, starts, stops, both, weight=False)


def weight_terms(inputs: CostInputs, starts: ArrayOrInt, stops: ArrayOrInt) -> ArrayOrFloat:
    """W of stages [start, stop) under a zero-bubble schedule, seconds per microbatch: sigma x their layers'
    weight-gradient parts (`LayerArrays.weight_s`), a first stage's unsplit (`first_terms`); 0 under other
    schedules. Element-wise."""
    if inputs.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return np.zeros(np.shape(starts)) if np.ndim(starts) else 0.0
    weight_s = inputs.arrays.weight_s
    return first_terms(inputs, starts, stops, inputs.scale * (weight_s[stops] - weight_s[starts]), weight=True)


def first_terms(inputs: CostInputs, starts: ArrayOrInt, stops: ArrayOrInt, values: ArrayOrFloat,
                weight: bool) -> ArrayOrFloat:
    """`values` (forward + backward, or W if `weight`) with the first stages' (start 0) replaced by
    their unsplit ones under a zero-bubble schedule whose arrays carry a split backward's ratio f > 1
    (`LayerArrays.first_stage_unsplit`, x sigma): the engine's first stage has no input gradient to
    compute, so its B is empty and its W is one whole backward, and it defers no W (it runs at the same
    place). The round trip (`fill_drain_s`) still counts the first stage's B split: a constant over the
    plans, which overstates a zero-bubble iteration by up to (1 - 1 / f) x the first stage's B."""
    arrays = inputs.arrays
    if inputs.schedule not in SPLIT_BACKWARD_SCHEDULES or arrays.split_applied == 1.0 or not np.any(
            np.asarray(starts) == 0):
        return values
    unsplit = inputs.scale * arrays.first_stage_unsplit(np.asarray(stops))[int(weight)]
    found = np.where(np.asarray(starts) == 0, unsplit, values)
    return found if np.ndim(found) else float(found)


def backward_top_terms(inputs: CostInputs, starts: ArrayOrInt, stops: ArrayOrInt, workspace: ArrayOrFloat
                       ) -> tuple[ArrayOrFloat, ArrayOrFloat]:
    """(b, v) of stages [start, stop), bytes: what a backward holds beyond saved activations at its peak, and
    what a zero-bubble W holds beyond the gradients it starts from. Under a zero-bubble schedule b = sigma
    `LayerArrays.kept_workspace_bytes` (at a layer what B holds there with what the layers after it keep for
    W) and v = `LayerArrays.weight_workspace_in` (not scaled), but on a first stage (its B computes nothing; its W
    is its whole backward) and under other schedules b = `workspace` (already scaled) and v = 0. Element-wise."""
    if inputs.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return workspace, np.zeros_like(workspace) if np.ndim(workspace) else 0.0
    arrays = inputs.arrays
    first = np.atleast_1d(starts) == 0
    kept = inputs.scale * arrays.kept_workspace_bytes(np.atleast_1d(starts), np.atleast_1d(stops))
    largest = arrays.weight_workspace_in(np.atleast_1d(starts), np.atleast_1d(stops))
    top, weight_top = np.where(first, workspace, kept), np.where(first, 0.0, largest)
    return (top, weight_top) if np.ndim(starts) else (float(top[0]), float(weight_top[0]))


def deferred_terms(inputs: CostInputs, starts: ArrayOrInt, stops: ArrayOrInt) -> ArrayOrFloat:
    """g of stages [start, stop) under a zero-bubble schedule, bytes per microbatch: sigma x what their layers
    keep from a B to its W (`LayerArrays.deferred_bytes`); 0 for a first stage (its inputs are data: its B
    computes nothing and its W, the whole backward, runs at once) and under other schedules. Element-wise."""
    if inputs.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return np.zeros(np.shape(starts)) if np.ndim(starts) else 0.0
    deferred = inputs.arrays.deferred_bytes
    return np.where(np.asarray(starts) > 0, inputs.scale * (deferred[stops] - deferred[starts]), 0.0)


StageMemo = dict[tuple[int, int, int, bool, int, int, tuple[int, int] | None], StageCost]


def stage_costs(inputs: CostInputs, stages: list[Stage], memo: StageMemo | None = None) -> list[StageCost]:
    """The terms of every stage of a plan, placed as in the module docstring (`tied_s` included). `memo`: a dict
    the caller keeps for one `inputs`, where each `stage_cost` is kept by its arguments, so that the plans of a
    search, which share most of their stages, compute each once (a 16-stage plan's simulation x1.8 faster)."""
    ranks = first_ranks(inputs, stages)
    costs, from_here = [], 0
    for index, ((start, stop, replicas, recompute), rank) in reversed(list(enumerate(zip(stages, ranks)))):
        from_here += replicas
        neighbours = None if inputs.chunks == 1 else (ranks[index - 1] if index > 0 else rank,
                                                        ranks[index + 1] if index + 1 < len(ranks) else rank)
        key = (start, stop, replicas, recompute, rank, from_here, neighbours)
        cost = None if memo is None else memo.get(key)
        if cost is None:
            cost = stage_cost(inputs, start, stop, replicas, recompute, rank, from_here, neighbours)
            if memo is not None:
                memo[key] = cost
        costs.append(cost)
    return [cost if tied == 0.0 else dataclasses.replace(cost, tied_s=tied)  # (replace is slow: most stages tie nothing)
            for cost, tied in zip(costs[::-1], tied_allreduce_s(inputs, stages))]


def tied_allreduce_s(inputs: CostInputs, stages: list[Stage]) -> list[float]:
    """Per stage, seconds of summing the gradients of tied weights across the ranks holding them, before
    the optimizer step: for each shared parameter of S bytes in two or more stages, held by g >= 2 distinct
    ranks (a rank holding it in two stages, as zbv's rank 0 holds gpt's embedding and head, holds one
    Parameter), a ring
    all-reduce 2 (g - 1)(S / (g bw) + lat) over the slowest link among them (`allreduce_s`); a rank's
    total over its tied parameters goes on its last stage (the engine sums them once per iteration, at
    that stage's step); 0 elsewhere, and under pipedream (each stage steps on its own there: the engine
    refuses weights tied across stages). The closed form Q leaves it out (it depends on where the other
    users are); the simulator plays it, every holder waiting for all."""
    firsts = first_ranks(inputs, stages)
    found = [0.0] * len(stages)
    if inputs.schedule == "pipedream":
        return found
    ranks_of = [range(first, first + replicas) for first, (_, _, replicas, _) in zip(firsts, stages)]
    per_rank: dict[int, float] = {}
    for first, others, nbytes in inputs.arrays.shared:
        holders = [index for index, (start, stop, _, _) in enumerate(stages)
                   if any(start <= layer < stop for layer in (first, *others))]
        group = sorted({rank for index in holders for rank in ranks_of[index]})
        if len(holders) < 2 or len(group) < 2:  # in one stage, an ordinary weight of its replicas
            continue
        seconds = float(allreduce_s(nbytes, len(group), *allreduce_terms(inputs.cluster, group[0], group[-1])))
        for rank in group:
            per_rank[rank] = per_rank.get(rank, 0.0) + seconds
    for rank, seconds in per_rank.items():
        found[max(index for index, held in enumerate(ranks_of) if rank in held)] = seconds
    return found


def fill_drain_s(inputs: CostInputs, stages: list[Stage]) -> float:
    """sum_s t(s): one microbatch through every stage and back, seconds (0 for pipedream); zero-bubble
    schedules leave out the W's (the gradient goes back after B; `time_terms` counts the stage's own W)."""
    if inputs.schedule == "pipedream":
        return 0.0
    total = inputs.scale * float(inputs.arrays.compute_s[-1])
    if inputs.schedule in SPLIT_BACKWARD_SCHEDULES:
        total -= inputs.scale * float(inputs.arrays.weight_s[-1])
    recomputed = sum(
        inputs.scale * float(inputs.arrays.fwd_s[stop] - inputs.arrays.fwd_s[start])
        for start, stop, _, recompute in stages if recompute
    )
    return total + recomputed


def objective_s(inputs: CostInputs, stages: list[Stage], costs: list[StageCost] | None = None) -> float:
    """The iteration time of a flush schedule, or the time per microbatch of pipedream (seconds);
    under a chunked schedule `chunked_objective_s`. `costs`: the plan's `stage_costs`, where the caller
    has them already."""
    if costs is None:
        costs = stage_costs(inputs, stages)
    if inputs.chunks > 1:
        return chunked_objective_s(inputs, stages, costs)
    return fill_drain_s(inputs, stages) + max(cost.bound_s for cost in costs)


def chunked_objective_s(inputs: CostInputs, stages: list[Stage], costs: list[StageCost] | None = None) -> float:
    """A chunked schedule's closed form, seconds: the busiest rank's work plus the bubble,

        iteration = max_r sum_(s on r) [m max(t + acc, c_in, c_out)(s) + opt(s)] + (p - 1) / (p v) sum_s x(s)

    (p ranks, v chunks each). interleaved-1f1b: x = t, so on equal chunks m v t + (p - 1) t, 1f1b's bubble
    over v (Narayanan et al. 2021). zbv: x = the forward alone (its B's and W's fill the rest), so on equal
    chunks m v t + (p - 1) f: the first forward's way down to the last rank (Qi et al. 2024 with F = B = W).
    Transfers during warm-up and drain and the first microbatch's accumulation are not counted; the
    simulator plays them. `costs`: the plan's `stage_costs`, where the caller has them already."""
    if costs is None:
        costs = stage_costs(inputs, stages)
    ranks = first_ranks(inputs, stages)
    count = len(stages) // inputs.chunks
    busy = [0.0] * count
    for rank, cost in zip(ranks, costs):
        busy[rank] += inputs.microbatches * max(cost.compute_s + cost.accumulate_s, cost.comm_in_s, cost.comm_out_s)
        busy[rank] += cost.step_s
    filling = [cost.fwd_s if inputs.schedule == "zbv" else cost.compute_s for cost in costs]
    return max(busy) + (count - 1) / (count * inputs.chunks) * sum(filling)


def plan_fits(inputs: CostInputs, stages: list[Stage], memo: StageMemo | None = None) -> bool:
    """True when the placement rule holds and every device fits the memory limit (if any); `memo` as in
    `stage_costs`."""
    ranks = first_ranks(inputs, stages)
    if ranks[0] < 0 or not all(bool(placement_ok(inputs.cluster, rank, replicas))
                               for rank, replicas in zip(ranks, replicas_of(stages))):
        return False
    if inputs.memory_bytes is None:
        return True
    return all(cost.memory_bytes <= inputs.memory_bytes for cost in stage_costs(inputs, stages, memo))


def samples_per_s(inputs: CostInputs, objective: float, microbatch_size: float) -> float:
    """Throughput: m u / iteration for flush schedules, u / time per microbatch for pipedream."""
    if objective <= 0:
        return math.inf
    count = 1 if inputs.schedule == "pipedream" else inputs.microbatches
    return count * microbatch_size / objective
