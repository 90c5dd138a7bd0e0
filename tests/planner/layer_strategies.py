"""Hypothesis strategies shared by the optimizer tests: random small profiles as LayerArrays."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from planner.costs.layer_arrays import LayerArrays


@st.composite
def layer_arrays(draw: st.DrawFn) -> LayerArrays:
    """1-5 layers: compute 0-100 ms (forward a share of it), parameters, cuts, saved activations and
    each backward's workspace, parameter tensors, weight-gradient share and what a split backward keeps from B to W,
    holds in its B (or not measured), frees after B (the gradients B keeps then exceed what waits for W), makes
    in its W (a share of the layer's weights, or a call of several), and saves of what an earlier layer counted."""
    n = draw(st.integers(1, 5))
    # times from 1 us up (or exactly 0): subnormal floats would make "equal" meaningless; the
    # powers of two add exactly, so different plans tie exactly
    compute = draw(st.lists(st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.1, 0.03125, 0.0625]) | st.floats(1e-6, 0.1),
                            min_size=n, max_size=n))
    shares = draw(st.lists(st.sampled_from([0.0, 0.25, 1 / 3, 0.5, 1.0]), min_size=n, max_size=n))
    forward = [time * share for time, share in zip(compute, shares)]
    params = draw(st.lists(st.sampled_from([0.0, 1e6, 5e7, 2e8, 4e8]), min_size=n, max_size=n))
    cuts = draw(st.lists(st.sampled_from([0.0, 1e5, 1e7, 1e8, 4e8]), min_size=n, max_size=n))
    saved = draw(st.lists(st.sampled_from([0.0, 1e6, 1e8, 4e8]), min_size=n, max_size=n))
    workspace = draw(st.lists(st.sampled_from([0.0, 1e6, 1e8, 4e8]), min_size=n, max_size=n))
    deferred = draw(st.lists(st.sampled_from([0.0, 1e6, 1e8, 4e8]), min_size=n, max_size=n))  # kept from B to W
    tensors = draw(st.lists(st.sampled_from([0, 1, 2, 40]), min_size=n, max_size=n))  # parameter tensors
    held_in_b = draw(st.none() | st.lists(st.sampled_from([0.0, 1e6, 1e8, 4e8]), min_size=n, max_size=n))
    largest_shares = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    freed = draw(st.lists(st.sampled_from([0.0, 0.0, 1e6, 1e8]), min_size=n, max_size=n))  # B frees, so kept > waits
    calls = draw(st.none() | st.lists(st.sampled_from([0.0, 1e6, 3e8]), min_size=n, max_size=n))  # one W call's
    # the part of a layer's saved bytes made before it (its input, which a stage starting there receives)
    input_shares = draw(st.lists(st.sampled_from([0.0, 0.0, 0.5, 1.0]), min_size=n, max_size=n))
    # the weight-gradient part (W) of each backward, a share of it (zero-bubble schedules)
    weight_shares = draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=n, max_size=n))
    weight = [(time - fwd) * share for time, fwd, share in zip(compute, forward, weight_shares)]
    # the backward times as a zero-bubble schedule runs them: split, f times the whole (`for_schedule`), but for a
    # first stage's (`schedule_cost.first_terms`); 1: as other schedules run them
    ratio = draw(st.sampled_from([1.0, 1.0, 1.5]))
    shared: tuple[tuple[int, tuple[int, ...], float], ...] = ()
    if n >= 2 and draw(st.booleans()):
        shared = ((0, (n - 1,), float(draw(st.sampled_from([1e6, 1e8, 4e8])))),)  # a tied first/last weight
        # counted in its first user's parameters, as a profile counts it (`LayerArrays.shared`): drawn apart from
        # them, the tie could outweigh them, which no model does (a stage's "replicated" bytes came out negative)
        params[0] += shared[0][2]
    return LayerArrays(
        compute_s=np.concatenate([[0.0], np.cumsum(compute)]),
        param_bytes=np.concatenate([[0.0], np.cumsum(params)]),
        cut_bytes=np.array(cuts[:-1] + [0.0]),
        saved_bytes=np.concatenate([[0.0], np.cumsum(saved)]),
        shared=shared,
        fwd_s=np.concatenate([[0.0], np.cumsum(forward)]),
        workspace_bytes=np.array(workspace),
        param_tensors=np.concatenate([[0.0], np.cumsum(tensors)]),
        weight_s=np.concatenate([[0.0], np.cumsum(weight)]),
        deferred_bytes=np.concatenate([[0.0], np.cumsum(deferred)]),
        split_backward_ratio=ratio, split_applied=ratio,
        input_workspace_bytes=None if held_in_b is None else np.array(held_in_b),
        largest_param_bytes=np.array([nbytes * share for nbytes, share in zip(params, largest_shares)]),
        kept_bytes=np.concatenate([[0.0], np.cumsum(np.array(deferred) + np.array(freed))]),
        weight_workspace_bytes=None if calls is None else np.array(calls),
        input_saved_bytes=np.array([nbytes * share for nbytes, share in zip(saved, input_shares)]),
    )

