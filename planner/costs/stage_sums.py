"""Every candidate stage [i, j) of a profile as flat arrays of its sums, scaled to the microbatch (pure)."""

from __future__ import annotations

import numpy as np

from planner.costs.layer_arrays import stage_pairs
from planner.costs.schedule_cost import (
    CostInputs, backward_top_terms, both_terms, deferred_terms, received_terms, weight_terms,
)


class Pairs:
    """Every candidate stage [i, j), i < j, as flat arrays ordered by i then j (scaled to the microbatch)."""

    def __init__(self, inputs: CostInputs) -> None:
        arrays, sigma = inputs.arrays, inputs.scale
        n = arrays.num_layers
        starts, stops, self.offsets = stage_pairs(n)
        self.num_layers = n
        self.starts, self.stops = starts, stops
        self.fwd = sigma * (arrays.fwd_s[stops] - arrays.fwd_s[starts])
        self.both = both_terms(inputs, starts, stops)  # a zero-bubble first stage's backward unsplit
        self.weight = weight_terms(inputs, starts, stops)  # W (zero-bubble schedules; else 0)
        self.deferred = deferred_terms(inputs, starts, stops)  # kept from B to W (zero-bubble schedules; else 0)
        cut = np.concatenate([arrays.cut_bytes, [0.0]]) * sigma
        self.cut_in = np.where(starts > 0, cut[starts - 1], 0.0)
        self.cut_out = np.where(stops < n, cut[stops - 1], 0.0)
        self.entering = np.where(starts > 0, self.cut_in, sigma * inputs.input_bytes)
        self.received = received_terms(inputs, starts, self.entering)  # kept beyond saved activations
        weights = arrays.pair_weight_bytes(starts, stops)  # with copies of shared parameters
        self.weights = weights
        self.frozen = arrays.pair_frozen_bytes(starts, stops)  # weights that need no gradient, with shared copies
        self.replicated = arrays.pair_replicated_bytes(starts, stops)  # what the replicas all-reduce
        self.tied = arrays.pair_tied_bytes(starts, stops)  # the largest tied weight all-reduced across stages
        self.tensors = arrays.pair_tensor_counts(starts, stops)  # parameter tensors, shared copies included
        self.saved = sigma * arrays.pair_saved_bytes(starts, stops)
        self.workspace = sigma * arrays.pair_workspace_bytes(self.offsets)
        self.largest = arrays.largest_param_in(starts, stops)  # the largest parameter tensor (the step's scratch)
        # b and v: what a B holds, what a W holds beyond its kept gradients (memory_terms)
        self.backward_top, self.weight_top = backward_top_terms(inputs, starts, stops, self.workspace)
