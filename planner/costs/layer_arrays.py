"""What both cost models read: prefix sums over a profile's layers (at a microbatch size), candidate stages,
optimizer state copies."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from planner.files.profile import Profile
from planner.schedules.schedule import SPLIT_BACKWARD_SCHEDULES

OPTIMIZER_STATE_COPIES = {"adam": 2, "sgd": 1}  # optimizer state per parameter byte (Adam: 2 moments; SGD: momentum)
ASSUMED_WEIGHT_SHARE = 0.5  # W / backward where the profile did not measure input gradients (a linear layer's dW ~ dX)


def per_weight_byte(profile: Profile, optimizer: str) -> tuple[float, float, float, float, float]:
    """(step seconds, step scratch bytes, accumulation seconds) per parameter byte, step seconds per
    parameter tensor and per step call: one `optimizer` step's time and scratch memory and one gradient
    accumulation's time over the whole model (`Profile.optimizer_step_ms`, `optimizer_scratch_bytes`,
    `grad_accumulation_ms`) divided by its parameter bytes that need a gradient (the others have none to
    step or add), the step's time after taking off its per-call cost (`optimizer_step_per_call_ms`, once) and
    its per-tensor cost (`optimizer_step_per_tensor_ms` x the model's tensors) when measured, each at most
    what is left of the step; 0 for what the profile did not measure. So a one-stage plan steps in the measured
    time, and a plan of k stages that step pays the per-call cost k times."""
    total = profile.trainable_param_bytes
    if total <= 0:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    step_ms = profile.optimizer_step_ms.get(optimizer, 0.0)
    per_call_ms = min(profile.optimizer_step_per_call_ms.get(optimizer, 0.0), step_ms)
    step_ms -= per_call_ms
    per_tensor_ms = profile.optimizer_step_per_tensor_ms.get(optimizer, 0.0) if profile.param_tensors else 0.0
    per_tensor_ms = min(per_tensor_ms, step_ms / max(sum(profile.param_tensors), 1))
    step_ms -= per_tensor_ms * sum(profile.param_tensors)
    scratch = 0 if scratch_per_largest(profile, optimizer) else profile.optimizer_scratch_bytes.get(optimizer, 0)
    return (step_ms / 1000.0 / total, scratch / total, profile.grad_accumulation_ms / 1000.0 / total,
            per_tensor_ms / 1000.0, per_call_ms / 1000.0)


def optimizer_terms(profile: Profile, optimizer: str) -> dict[str, float]:
    """`CostInputs`' optimizer fields for `profile` and `optimizer`, by name: `per_weight_byte`'s five and
    `scratch_per_largest`."""
    names = ("step_s_per_byte", "scratch_per_byte", "accumulate_s_per_byte", "step_s_per_tensor", "step_s_per_call")
    return {**dict(zip(names, per_weight_byte(profile, optimizer))),
            "scratch_per_largest": scratch_per_largest(profile, optimizer)}


def scratch_per_largest(profile: Profile, optimizer: str) -> float:
    """The optimizer step's scratch memory per byte of the largest parameter tensor it steps, on a CPU profile
    that records each layer's largest (`largest_param_bytes`); 0 elsewhere, where `per_weight_byte` prices it per
    parameter byte. torch steps one tensor at a time on CPU (`_single_tensor_adam`: temporaries the size of the
    tensor at hand), so the step's scratch is its largest tensor's: the mlp example's Adam step held 2 x its 4.2 MB
    weight on both stages, 10.5 and 12.6 MB of weights, where a share per byte predicted 3.0 and 3.6 MB. On CUDA
    it steps a device's tensors together (foreach), and the scratch grows with all their bytes."""
    largest = max(getattr(profile, "largest_param_bytes", ()) or (0,))
    if not profile.device.startswith("cpu") or largest <= 0:
        return 0.0
    return profile.optimizer_scratch_bytes.get(optimizer, 0) / largest


@dataclass(frozen=True)
class LayerArrays:
    """Prefix sums over a profile's layers: stage [i, j) totals are `x[j] - x[i]`.

    `compute_s`: forward + backward seconds; `fwd_s`: forward seconds alone (None: all zero);
    `param_bytes`: of the parameters that need a gradient (they have gradients, optimizer state, all-reduces);
    `frozen_bytes`: of those that need none (weights alone; None: all zero), with `frozen_shared` their shared
    ones as `shared` is for `param_bytes`; `cut_bytes[k]`: bytes crossing the
    boundary after layer k (not a prefix sum); `saved_bytes`: activation bytes kept per
    in-flight mini-batch (None: all zero); `shared`: parameters used by several layers, as
    (first layer, other layers, bytes): `param_bytes` counts them at the first layer only, a
    stage holding one of the other layers holds a copy too; `workspace_bytes[k]`: bytes layer k's
    backward, or its forward if more, holds beyond saved activations (not a prefix sum; None: all zero); `param_tensors`:
    parameter tensors, a prefix sum counted as `param_bytes` (None: all zero; a shared one's copy
    counts 1). `weight_s`: the weight-gradient part (W) of each layer's backward, seconds, a prefix
    sum: backward - input-gradient part where the profile measured it (`bwd_input_ms`), else
    ASSUMED_WEIGHT_SHARE x backward (None: that for every layer); `weight_measured`: whether every layer's was measured;
    `split_backward_ratio`: a backward run as B then W over one run whole (`Profile.split_backward_ratio`,
    at least 1: below is noise; 1.0 where not measured), which `for_schedule` applies to the zero-bubble
    schedules' backwards. `deferred_bytes`: what a microbatch holds from its B to its W beyond its saved
    activations under a zero-bubble schedule, a prefix sum: per layer the gradients B keeps for W less the saved
    tensors B frees, at least 0 (`Profile.deferred_bytes`, `freed_by_b_bytes`; where not measured, each layer
    after the first is assumed to keep its output's size, one recorded gradient; None: all zero); `kept_bytes`:
    the gradients alone, a prefix sum (what a running B holds for the layers after it; None: `deferred_bytes`);
    `deferred_measured`: whether the profile measured it. `input_workspace_bytes[k]`: what a split backward's B
    holds at layer k beyond saved activations and the gradients the layers after k keep for W (b_k, not a
    prefix sum; the larger of it and the layer's forward workspace, since a forward runs while other
    microbatches wait for their W; None: not measured, see `kept_workspace_bytes`). `largest_param_bytes[k]`:
    the largest parameter that layer k uses and trains, bytes (not a prefix sum; None: all zero).
    `weight_workspace_bytes[k]`: what a W holds for layer k beyond the gradients it starts from, bytes (the larger
    of `Profile.weight_workspace_bytes` and `largest_param_bytes`; not a prefix sum; None: `largest_param_bytes`).
    `input_saved_bytes[k]`: the part of layer k's saved bytes made before it, its received inputs where a stage
    starts at k (`Profile.input_saved_bytes`; not a prefix sum; None: all zero).
    """

    compute_s: np.ndarray
    param_bytes: np.ndarray
    cut_bytes: np.ndarray
    saved_bytes: np.ndarray | None = None
    shared: tuple[tuple[int, tuple[int, ...], float], ...] = ()
    fwd_s: np.ndarray | None = None
    workspace_bytes: np.ndarray | None = None
    param_tensors: np.ndarray | None = None
    weight_s: np.ndarray | None = None
    weight_measured: bool = False
    split_backward_ratio: float = 1.0
    split_applied: float = 1.0  # the ratio the backward times carry now (`for_schedule`)
    deferred_bytes: np.ndarray | None = None
    deferred_measured: bool = False
    kept_bytes: np.ndarray | None = None
    weight_workspace_bytes: np.ndarray | None = None
    input_workspace_bytes: np.ndarray | None = None
    largest_param_bytes: np.ndarray | None = None
    input_saved_bytes: np.ndarray | None = None
    frozen_bytes: np.ndarray | None = None
    frozen_shared: tuple[tuple[int, tuple[int, ...], float], ...] = ()

    def __post_init__(self) -> None:
        if self.fwd_s is None:
            object.__setattr__(self, "fwd_s", np.zeros_like(self.compute_s))
        if self.workspace_bytes is None:
            object.__setattr__(self, "workspace_bytes", np.zeros(len(self.cut_bytes)))
        if self.param_tensors is None:
            object.__setattr__(self, "param_tensors", np.zeros_like(self.param_bytes))
        if self.weight_s is None:
            object.__setattr__(self, "weight_s", ASSUMED_WEIGHT_SHARE * (self.compute_s - self.fwd_s))
        if self.deferred_bytes is None:
            object.__setattr__(self, "deferred_bytes", np.zeros_like(self.compute_s))
        if self.frozen_bytes is None:
            object.__setattr__(self, "frozen_bytes", np.zeros_like(self.param_bytes))
        if self.largest_param_bytes is None:
            object.__setattr__(self, "largest_param_bytes", np.zeros(len(self.cut_bytes)))
        if self.input_saved_bytes is None:
            object.__setattr__(self, "input_saved_bytes", np.zeros(len(self.cut_bytes)))
        for shared, prefix, what in ((self.shared, self.param_bytes, "param_bytes"),
                                     (self.frozen_shared, self.frozen_bytes, "frozen_bytes")):
            own = _own_bytes(prefix, shared) if shared else None
            if own is not None and (own < -1e-9 * max(1.0, float(prefix[-1]))).any():
                layer = int(np.argmin(own))
                raise ValueError(f"the shared parameters first used by layer {layer} outweigh its {what} by "
                                 f"{-own[layer]:.0f}: a shared parameter is counted in its first layer's {what}")

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.cut_bytes)

    @classmethod
    def from_profile(cls, profile: Profile) -> "LayerArrays":
        """Prefix sums of a profile's layers (times converted from ms to seconds)."""
        compute = np.array([(layer.fwd_ms + layer.bwd_ms) / 1000.0 for layer in profile.layers])
        forward = np.array([layer.fwd_ms / 1000.0 for layer in profile.layers])
        frozen = np.array([float(nbytes) for nbytes in profile.frozen_param_bytes] or [0.0] * len(profile.layers))
        params = np.array([float(layer.param_bytes) for layer in profile.layers]) - frozen
        saved = np.array([float(layer.saved_bytes) for layer in profile.layers])
        inputs_ms = [getattr(layer, "bwd_input_ms", None) for layer in profile.layers]
        measured = all(ms is not None for ms in inputs_ms)
        weight = np.array([(layer.bwd_ms - min(max(ms, 0.0), layer.bwd_ms) if measured
                            else ASSUMED_WEIGHT_SHARE * layer.bwd_ms) / 1000.0
                           for layer, ms in zip(profile.layers, inputs_ms)])
        deferred_measured = bool(getattr(profile, "deferred_bytes", ()))
        kept = (np.array(profile.deferred_bytes, dtype=float) if deferred_measured
                else np.array([0.0] + [float(layer.output_bytes) for layer in profile.layers[1:]]))
        freed = getattr(profile, "freed_by_b_bytes", ())
        deferred = np.maximum(kept - np.array(freed, dtype=float), 0.0) if freed else kept
        largest = np.array(profile.largest_param_bytes, dtype=float) if getattr(profile, "largest_param_bytes", ()) \
            else np.zeros(len(profile.layers))
        calls = getattr(profile, "weight_workspace_bytes", ())
        return cls(
            compute_s=np.concatenate([[0.0], np.cumsum(compute)]),
            param_bytes=np.concatenate([[0.0], np.cumsum(params)]),
            cut_bytes=np.array([float(layer.cut_bytes) for layer in profile.layers]),
            saved_bytes=np.concatenate([[0.0], np.cumsum(saved)]),
            shared=tuple((p.layers[0], tuple(p.layers[1:]), float(p.nbytes)) for p in profile.shared_params
                         if not p.frozen),
            frozen_bytes=np.concatenate([[0.0], np.cumsum(frozen)]),
            frozen_shared=tuple((p.layers[0], tuple(p.layers[1:]), float(p.nbytes)) for p in profile.shared_params
                                if p.frozen),
            fwd_s=np.concatenate([[0.0], np.cumsum(forward)]),
            workspace_bytes=_working_bytes(profile),
            param_tensors=np.concatenate([[0.0], np.cumsum(profile.param_tensors)]) if profile.param_tensors else None,
            weight_s=np.concatenate([[0.0], np.cumsum(weight)]), weight_measured=measured,
            split_backward_ratio=max(1.0, float(getattr(profile, "split_backward_ratio", None) or 1.0)),
            deferred_bytes=np.concatenate([[0.0], np.cumsum(deferred)]), deferred_measured=deferred_measured,
            kept_bytes=np.concatenate([[0.0], np.cumsum(kept)]),
            input_workspace_bytes=_input_working_bytes(profile), largest_param_bytes=largest,
            weight_workspace_bytes=np.maximum(largest, np.array(calls, dtype=float)) if calls else largest,
            input_saved_bytes=np.array(profile.input_saved_bytes, dtype=float)
            if getattr(profile, "input_saved_bytes", ()) else None,
        )

    @classmethod
    def at_batch_size(cls, profile: Profile, size: int) -> "LayerArrays":
        """`from_profile` with the layers' times at microbatches of `size` samples interpolated between the
        profile's measured batch sizes (`times_at_batch_size`), per profiled mini-batch: the cost model's
        scale sigma = size / batch_size turns them into the interpolated times. The same arrays as
        `from_profile` for a profile measured at one batch size."""
        return cls.from_profile(times_at_batch_size(profile, size))

    def for_schedule(self, schedule: str) -> "LayerArrays":
        """These arrays as `schedule` runs the layers: under a zero-bubble schedule every backward, B and W
        alike, takes `split_backward_ratio` times its time; under the others its whole time (backward_s' =
        f (compute_s - fwd_s), weight_s' = f weight_s with f the wanted ratio over the one applied now).
        The same arrays where nothing changes."""
        wanted = self.split_backward_ratio if schedule in SPLIT_BACKWARD_SCHEDULES else 1.0
        factor = wanted / self.split_applied
        if factor == 1.0:
            return self
        return dataclasses.replace(self, compute_s=self.fwd_s + factor * (self.compute_s - self.fwd_s),
                                   weight_s=factor * self.weight_s, split_applied=wanted)

    def first_stage_unsplit(self, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(forward + backward, W) seconds of first stages [0, stop) whose backward runs whole where the
        arrays carry a split one (`split_applied` = f > 1): a first stage has no input gradient to compute,
        so its B is empty and its W is one backward, at f = 1: fwd_s + (compute_s - fwd_s) / f and
        weight_s / f at each stop (the weight-gradient share kept, so B + W = the whole backward)."""
        backward = (self.compute_s[stops] - self.fwd_s[stops]) / self.split_applied
        return self.fwd_s[stops] + backward, self.weight_s[stops] / self.split_applied

    def stage_saved_bytes(self, start: int, stop: int) -> float:
        """Activation bytes the layers [start, stop) save per mini-batch, each storage counted at its first saver
        (PipeDream's cost model reads these; what a pipeline stage keeps is `pair_saved_bytes`)."""
        return 0.0 if self.saved_bytes is None else float(self.saved_bytes[stop] - self.saved_bytes[start])

    def pair_saved_bytes(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """Activation bytes stages [start, stop) keep per in-flight mini-batch beyond their inputs (element-wise):
        their layers' `saved_bytes` less what the first layer saves of what it receives (`input_saved_bytes[start]`):
        the runtime runs a stage on the tensors it received, so what that layer saves of them is the received
        tensors themselves, counted apart (`schedule_cost.received_terms`)."""
        starts, stops = np.asarray(starts), np.asarray(stops)
        if self.saved_bytes is None:
            return np.zeros(len(starts))
        return self.saved_bytes[stops] - self.saved_bytes[starts] - self.input_saved_bytes[starts]

    def stage_workspace_bytes(self, start: int, stop: int) -> float:
        """The most any layer of a stage [start, stop) holds during its backward beyond saved activations."""
        return float(np.max(self.workspace_bytes[start:stop]))

    def pair_workspace_bytes(self, offsets: np.ndarray) -> np.ndarray:
        """`stage_workspace_bytes` of every stage of `stage_pairs` (ordered by start, then stop; `offsets`
        as it returns them): running maxima from each start."""
        found = np.empty(int(offsets[-1]))
        for start in range(self.num_layers):
            found[offsets[start]:offsets[start + 1]] = np.maximum.accumulate(self.workspace_bytes[start:])
        return found

    def kept_workspace_bytes(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """b of stages [start, stop) (element-wise): the most a split backward's B holds beyond saved
        activations, bytes per mini-batch. At layer k, what B holds there (`input_workspace_bytes`, b_k: the
        gradient flowing in, temporaries, and what k keeps for W as it goes) plus what the stage's layers after
        k keep for W: b = G[stop] + max_k (b_k - G[k + 1]), G = `kept_bytes` (prefix sums; B frees no saved
        tensor while it runs). Where the profile did not measure b_k: the stage's workspace plus all it keeps,
        w + G[stop] - G[start], the most it can be."""
        kept = self.deferred_bytes if self.kept_bytes is None else self.kept_bytes
        if self.input_workspace_bytes is None:
            return range_max(self.workspace_bytes, starts, stops) + kept[stops] - kept[starts]
        return kept[stops] + range_max(self.input_workspace_bytes - kept[1:], starts, stops)

    def largest_param_in(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """The largest parameter tensor a layer of stages [start, stop) trains (element-wise), bytes
        (`largest_param_bytes`; the optimizer step's scratch on CPU)."""
        return range_max(self.largest_param_bytes, starts, stops)

    def weight_workspace_in(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """v of stages [start, stop) (element-wise): what a zero-bubble W holds beyond the gradients it starts
        from, bytes, not scaled with the batch (`weight_workspace_bytes`)."""
        own = self.largest_param_bytes if self.weight_workspace_bytes is None else self.weight_workspace_bytes
        return range_max(own, starts, stops)

    def stage_weight_bytes(self, start: int, stop: int) -> float:
        """Parameter bytes a stage [start, stop) holds: its own, plus a copy of each shared
        parameter it uses whose first user lies outside it."""
        return float(self.pair_weight_bytes(np.array([start]), np.array([stop]))[0])

    def stage_replicated_bytes(self, start: int, stop: int) -> float:
        """The bytes a stage's replicas all-reduce: `stage_weight_bytes` less the shared parameters whose
        users it does not all hold (those are summed with the other stages' copies instead)."""
        return float(self.pair_replicated_bytes(np.array([start]), np.array([stop]))[0])

    def pair_replicated_bytes(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """`stage_replicated_bytes` of many stages at once."""
        found = self.pair_weight_bytes(starts, stops)
        for nbytes, split in self._split_ties(starts, stops):
            found = found - np.where(split, nbytes, 0.0)
        return found

    def pair_tied_bytes(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """Per stage, the largest shared parameter (that trains) it holds while not every layer using it lies in it:
        one whose gradient the engine all-reduces across stages before the step, through a buffer of its bytes (0:
        none). A chunked plan whose rank holds every user (zbv's rank 0) does not all-reduce it: an upper bound there."""
        found = np.zeros(len(starts))
        for nbytes, split in self._split_ties(starts, stops):
            found = np.where(split, np.maximum(found, nbytes), found)
        return found

    def _split_ties(self, starts: np.ndarray, stops: np.ndarray) -> list[tuple[float, np.ndarray]]:
        """Per shared parameter (`shared`), its bytes and, per stage, whether the stage holds some but not every
        layer using it (its gradient is summed with other stages' copies)."""
        if len(starts) == 1:  # one stage (its reference terms): the masks without array arithmetic
            start, stop = int(starts[0]), int(stops[0])
            return [(nbytes, np.array([len({start <= layer < stop for layer in (first, *others)}) == 2]))
                    for first, others, nbytes in self.shared]
        found = []
        for first, others, nbytes in self.shared:
            held = [(starts <= layer) & (layer < stops) for layer in (first, *others)]
            found.append((nbytes, np.logical_or.reduce(held) & ~np.logical_and.reduce(held)))
        return found

    def unshared_param_bytes(self) -> np.ndarray:
        """`param_bytes` without the shared parameters (a prefix sum): a lower bound of every stage's
        weights and of what its replicas all-reduce."""
        return np.concatenate([[0.0], np.cumsum(_own_bytes(self.param_bytes, self.shared))])

    def stage_tensor_count(self, start: int, stop: int) -> float:
        """Parameter tensors a stage [start, stop) holds, shared copies included (as `stage_weight_bytes`)."""
        return float(self.pair_tensor_counts(np.array([start]), np.array([stop]))[0])

    def pair_weight_bytes(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """`stage_weight_bytes` of many stages [starts[k], stops[k]) at once."""
        return self._with_copies(self.param_bytes, starts, stops, lambda nbytes: nbytes)

    def stage_frozen_bytes(self, start: int, stop: int) -> float:
        """Bytes of the parameters needing no gradient a stage [start, stop) holds, shared copies included."""
        return float(self.pair_frozen_bytes(np.array([start]), np.array([stop]))[0])

    def pair_frozen_bytes(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """`stage_frozen_bytes` of many stages at once."""
        assert self.frozen_bytes is not None
        return self._with_copies(self.frozen_bytes, starts, stops, lambda nbytes: nbytes, self.frozen_shared)

    def pair_tensor_counts(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """`stage_tensor_count` of many stages at once."""
        return self._with_copies(self.param_tensors, starts, stops, lambda nbytes: 1.0)

    def _with_copies(self, prefix: np.ndarray, starts: np.ndarray, stops: np.ndarray,
                     per_copy: Callable[[float], float],
                     shared: tuple[tuple[int, tuple[int, ...], float], ...] | None = None) -> np.ndarray:
        """prefix[stop] - prefix[start], plus per_copy(bytes) for each shared parameter (`shared`, default
        `self.shared`) a stage uses whose first user lies outside it."""
        found = prefix[stops] - prefix[starts]
        if len(starts) == 1:  # one stage (its reference terms): without arrays
            start, stop = int(starts[0]), int(stops[0])
            return found + sum(per_copy(nbytes) for first, others, nbytes in (self.shared if shared is None else shared)
                               if not start <= first < stop and any(start <= layer < stop for layer in others))
        for first, others, nbytes in self.shared if shared is None else shared:
            holds_other = np.zeros(len(starts), dtype=bool)
            for layer in others:
                holds_other |= (starts <= layer) & (layer < stops)
            found = found + np.where(holds_other & ~((starts <= first) & (first < stops)), per_copy(nbytes), 0.0)
        return found

    def cut_before(self, start: int) -> float:
        """Bytes entering a stage that begins at layer `start` (0 for the first stage)."""
        return 0.0 if start == 0 else float(self.cut_bytes[start - 1])

    def cut_after(self, stop: int) -> float:
        """Bytes leaving a stage that ends before layer `stop` (0 for the last stage)."""
        return 0.0 if stop == self.num_layers else float(self.cut_bytes[stop - 1])


def _working_bytes(profile: Profile) -> np.ndarray | None:
    """Per layer, the larger of what its backward and its forward hold beyond saved activations (None: neither
    measured)."""
    measured = [np.array(values, dtype=float) for values in (profile.workspace_bytes,
                                                             getattr(profile, "forward_workspace_bytes", ())) if values]
    return np.maximum.reduce(measured) if measured else None


def _input_working_bytes(profile: Profile) -> np.ndarray | None:
    """Per layer, the larger of what a split backward's B holds there (`Profile.input_workspace_bytes`) and what
    its forward holds beyond saved activations (None: B's not measured)."""
    measured = getattr(profile, "input_workspace_bytes", ())
    if not measured:
        return None
    forward = getattr(profile, "forward_workspace_bytes", ()) or [0] * len(measured)
    return np.maximum(np.array(measured, dtype=float), np.array(forward, dtype=float))


def interpolate_ms(sizes: Sequence[int], times_ms: np.ndarray, size: float) -> np.ndarray:
    """Per layer, the time of a batch of `size` samples from `times_ms[k]` (one row per layer's time, ms)
    measured at `sizes[k]` (ascending, distinct, at least 1), ms: piecewise linear between neighbouring
    measured sizes, t(u) = t_k + (t_{k+1} - t_k) (u - b_k) / (b_{k+1} - b_k) for b_k <= u <= b_{k+1}, and
    proportional to u beyond them, from the nearest: t(u) = t_max u / b_max above the largest,
    t_min u / b_min below the smallest. At a measured size u = b_k, exactly t_k."""
    if size >= sizes[-1]:
        return times_ms[-1] * (size / sizes[-1])
    if size <= sizes[0]:
        return times_ms[0] * (size / sizes[0])
    k = bisect.bisect_right(sizes, size) - 1  # sizes[k] <= size < sizes[k + 1]
    share = (size - sizes[k]) / (sizes[k + 1] - sizes[k])
    return times_ms[k] + share * (times_ms[k + 1] - times_ms[k])


def times_at_batch_size(profile: Profile, size: int) -> Profile:
    """`profile` with each layer's `fwd_ms`, `bwd_ms` and `bwd_input_ms` those of a microbatch of `size`
    samples, t(size) by `interpolate_ms` over the sizes the profile measured (`Profile.batch_sizes`),
    expressed per mini-batch of its `batch_size` b: t(size) x b / size, so that the cost model's linear
    scale sigma = size / b gives back t(size). Bytes stay as they are (linear in the batch).
    `bwd_input_ms` is interpolated where every size measured it, else it keeps its share of `bwd_ms` at b.
    `profile` itself where it measured one size, or where `size` lies beyond its measured sizes on the
    side of b (t(size) is then b's times scaled linearly, as for one size)."""
    sizes = profile.batch_sizes
    if len(sizes) < 2 or (size >= sizes[-1] == profile.batch_size) or (size <= sizes[0] == profile.batch_size):
        return profile
    layers = profile.layers
    main_input_ms = tuple(layer.bwd_input_ms for layer in layers)
    measured = {profile.batch_size: (tuple(layer.fwd_ms for layer in layers), tuple(layer.bwd_ms for layer in layers),
                                     main_input_ms if None not in main_input_ms else ())}
    measured.update({sized.batch_size: (sized.fwd_ms, sized.bwd_ms, sized.bwd_input_ms) for sized in profile.size_times})
    per_batch = (profile.batch_size or 1) / size

    def at_size(column: int) -> list[float]:
        times_ms = np.array([measured[batch][column] for batch in sizes], dtype=float)
        return (interpolate_ms(sizes, times_ms, size) * per_batch).tolist()

    fwd_ms, bwd_ms = at_size(0), at_size(1)
    if all(measured[batch][2] for batch in sizes):
        input_ms: list[float | None] = list(at_size(2))
    else:  # the share of the backward the profiled batch spent on input gradients
        input_ms = [None if ms is None else (ms / layer.bwd_ms * bwd if layer.bwd_ms else 0.0)
                    for ms, layer, bwd in zip(main_input_ms, layers, bwd_ms)]
    return dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, fwd_ms=fwd, bwd_ms=bwd, bwd_input_ms=input_)
        for layer, fwd, bwd, input_ in zip(layers, fwd_ms, bwd_ms, input_ms)
    ), size_times=())


def batch_scaling_note(profile: Profile, size: int) -> str:
    """How the cost model took the layers' times at microbatches of `size` samples from `profile`
    (`times_at_batch_size`), for a plan's notes."""
    sizes = profile.batch_sizes
    if len(sizes) < 2:
        return f"times scaled linearly from the profiled batch of {profile.batch_size or 1} to {size}"
    listed = f"(measured: {', '.join(map(str, sizes))})"
    if size in sizes:
        return f"times as measured at batch size {size} {listed}"
    if size > sizes[-1] or size < sizes[0]:
        nearest = sizes[-1] if size > sizes[-1] else sizes[0]
        return (f"times extrapolated linearly {'beyond' if size > nearest else 'below'} the measured batch sizes: "
                f"scaled from {nearest} to {size} {listed}")
    k = bisect.bisect_right(sizes, size) - 1
    return f"times interpolated between measured batch sizes {sizes[k]} and {sizes[k + 1]} for {size} {listed}"


def stage_pairs(num_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every candidate stage [i, j), i < j, ordered by i then j: (starts, stops, offsets), where the
    stages starting at i occupy [offsets[i], offsets[i + 1])."""
    counts = np.arange(num_layers, 0, -1)  # stages starting at i end at i+1 .. n
    starts = np.repeat(np.arange(num_layers), counts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    stops = starts + 1 + (np.arange(len(starts)) - offsets[starts])
    return starts, stops, offsets


_DIRECT_RANGES = 4  # range_max takes each range's own maximum for at most this many ranges


def range_max(values: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """max(values[start:stop]) for each pair (start < stop), element-wise, from a sparse table: level j holds
    the maxima of the 2^j values from each index, and a range is the larger of the two 2^j-long ranges at its
    ends, j = floor(log2(stop - start)). O(n log n) to build, O(1) per range."""
    starts, stops = np.asarray(starts, dtype=int), np.asarray(stops, dtype=int)
    if starts.size <= _DIRECT_RANGES:  # (one stage's terms: the table costs more than the ranges' own maxima)
        return np.array([float(np.max(values[start:stop])) for start, stop in zip(starts.tolist(), stops.tolist())])
    levels = [np.asarray(values, dtype=float)]
    while 2 ** len(levels) <= len(levels[0]):
        below, half = levels[-1], 2 ** (len(levels) - 1)
        levels.append(np.maximum(below[:-half], below[half:]))
    level = np.floor(np.log2(np.maximum(stops - starts, 1))).astype(int)
    found = np.empty(len(starts))
    for j in np.unique(level):
        chosen = level == j
        found[chosen] = np.maximum(levels[j][starts[chosen]], levels[j][stops[chosen] - 2 ** j])
    return found


def _own_bytes(prefix: np.ndarray, shared: tuple[tuple[int, tuple[int, ...], float], ...]) -> np.ndarray:
    """Each layer's bytes of a prefix sum less the shared parameters it is the first user of (counted there)."""
    own = np.diff(prefix).copy()
    for first, _, nbytes in shared:
        own[first] -= nbytes
    return own
