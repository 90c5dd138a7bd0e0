"""End-to-end profiling of the shipped examples: layer times add up, bytes and sharing recorded."""

from __future__ import annotations

import pytest
import torch

from planner.display.tables import profile_summary
from planner.profiling.model_file import load_model_file
from planner.files.profile import Profile
from planner.errors import ModelFileError, ProfileError
from planner.profiling.conditions import default_cpu_processes
from planner.profiling.profiler import ProfileSettings, _processes, profile_model, smaller_batch_sizes
from tests.conftest import EXAMPLES, gpu_only
from tests.machine_lock import MachineLock

# More measured steps than the default, and one torch thread, so that the medians are steady on a
# shared 2-core machine: with two threads on two cores, any other process stalls torch's thread
# pool at random and the paired steps drift apart (seen: 1 run in 7 off by 11% on the mlp).
# (batch size, measured steps): gpt at batch 8 (a step of ~200 ms here) and 12 pairs of steps, 18 s alone (24 s at 20
# pairs); at batch 4 and 20 pairs (14 s) the hooks' share of a step doubled, and beside the suite's torchrun jobs the
# instrumented steps read 11.6% over the plain ones in one clean-clone run (1.00-1.03 alone)
# (vgg, a chain of convolutions as resnet's without the skips, left out: 5 s of a suite's CPU for nothing new)
SETTINGS = {"mlp": (8, 40), "resnet": (8, 30), "gpt": (8, 12)}
# and each timing phase runs for at least a second, as `planner profile` does by default: the input gradients'
# shares, a median of 5 pairs of the mlp's ~10 ms steps otherwise, read the middle layers' B at 0.29 of their
# backward (0.41-0.44 on a quiet machine) in one clean-clone run, below twice the first layer's
MIN_SECONDS = 1.0
# alone (processes=1): a companion would train each model on the other core for the whole fixture, beside the
# suite's other worker; profiles among companions run in test_companions.py and test_cli.py's default profile.
# And with the machine to itself (`machine_lock`): beside the other worker's torchrun jobs resnet's steps read
# 50-120 ms (23 ms alone), its pairs of steps 0.55-1.8x each other, and the median of 30 pairs 0.874 in one run


@pytest.fixture(scope="module")
def profiles(machine_lock: MachineLock) -> dict[str, Profile]:
    with machine_lock.exclusive():
        return {
            name: profile_model(
                load_model_file(EXAMPLES / f"{name}.py"),
                ProfileSettings(batch_size=batch, iters=iters, threads=1, min_seconds=MIN_SECONDS, processes=1)
            )
            for name, (batch, iters) in SETTINGS.items()
        }


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_layer_times_add_up_to_the_measured_step(profiles: dict[str, Profile], name: str) -> None:
    """The layers share out the plain step (`test_timing` pins that); on CPU the instrumented steps that gave the
    shares took about as long (the hooks' cost is small against the work, so the shares are the work's)."""
    profile = profiles[name]
    assert profile.settings["instrumented_ratio"] == pytest.approx(1.0, rel=0.10)
    assert all(layer.fwd_ms >= 0 and layer.bwd_ms >= 0 for layer in profile.layers)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_profile_is_complete(profiles: dict[str, Profile], name: str) -> None:
    profile = profiles[name]
    assert profile.batch_size == SETTINGS[name][0] and profile.device == "cpu" and profile.threads == 1
    conditions = profile.settings["conditions"]
    assert conditions["threads"] == 1 and conditions["cores"] >= 1 and "malloc" in conditions
    # the CPU its own processes and the others used while it timed (Linux: /proc)
    assert 0 < conditions["own_busy_cores"] <= conditions["cores"] and conditions["others_busy_cores"] >= 0
    assert set(profile.optimizer_step_ms) == {"sgd", "adam"} and all(ms > 0 for ms in profile.optimizer_step_ms.values())
    assert set(profile.optimizer_scratch_bytes) == {"sgd", "adam"}
    assert profile.optimizer_scratch_bytes["adam"] > 0  # Adam's step computes per-tensor intermediates
    assert profile.grad_accumulation_ms > 0
    assert profile.layers[-1].cut_bytes == 0
    assert all(layer.cut_bytes > 0 for layer in profile.layers[:-1])
    assert profile.peak_memory_method == "live-tensors" and profile.library_bytes == 0
    assert len(profile.workspace_bytes) == profile.num_layers and all(w >= 0 for w in profile.workspace_bytes)
    assert set(profile.optimizer_step_per_tensor_ms) == {"sgd", "adam"}
    assert all(0 < ms < profile.optimizer_step_ms[name] for name, ms in profile.optimizer_step_per_tensor_ms.items())
    assert all(layer.bwd_input_ms is not None and 0 <= layer.bwd_input_ms <= layer.bwd_ms for layer in profile.layers)
    assert profile.split_backward_ratio is not None and profile.split_backward_ratio > 0
    # a split backward keeps gradients for every weighted layer but the first (a stage's data input) and the last
    # (the loss's saved log-softmax, which B frees, is as large as the gradient its layer keeps)
    assert len(profile.deferred_bytes) == profile.num_layers and profile.deferred_bytes[0] == 0
    assert all(nbytes > 0 for nbytes, layer in zip(profile.deferred_bytes[1:-1], profile.layers[1:-1])
               if layer.param_bytes)
    assert len(profile.input_workspace_bytes) == profile.num_layers and profile.input_workspace_bytes[0] == 0
    assert all(nbytes > 0 for nbytes in profile.input_workspace_bytes[1:])  # at least the gradient flowing in
    # the largest weight a layer uses: one of its own, or a shared one (gpt's tied head holds no bytes of its own)
    largest = profile.largest_param_bytes
    assert all(0 < nbytes <= layer.param_bytes for nbytes, layer in zip(largest, profile.layers) if layer.param_bytes)
    assert all(largest[layer] >= shared.nbytes for shared in profile.shared_params for layer in shared.layers)
    # the peak holds at least the weights, their gradients and the largest saved activation
    assert profile.peak_memory_bytes >= 2 * profile.total_param_bytes + max(l.saved_bytes for l in profile.layers)
    # resnet's batch norms (a stem's, two per block, one per projection skip) normalise with the batch's statistics
    norms = ("bn1", "layer1.0.bn1", "layer1.0.bn2") if name == "resnet" else ()
    assert profile.batch_coupling is not None and profile.batch_coupling.batch_norm[:3] == norms
    assert len(profile.batch_coupling.batch_norm) == (15 if name == "resnet" else 0)
    assert profile.batch_coupling.across_samples is None and profile.batch_coupling.unchecked is None


def test_gpt_records_the_tied_embedding_once(profiles: dict[str, Profile]) -> None:
    profile = profiles["gpt"]
    (shared,) = profile.shared_params
    assert set(shared.names) == {"transformer.wte.weight", "lm_head.weight"}
    assert shared.layers == (0, [layer.name for layer in profile.layers].index("lm_head"))
    assert shared.nbytes == 8192 * 128 * 4
    assert profile.layers[0].param_bytes == shared.nbytes  # counted at the first user only
    assert profile.layers[-1].param_bytes == 0
    model = load_model_file(EXAMPLES / "gpt.py").build_model()
    assert profile.total_param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert sum(profile.param_tensors) == len(list(model.parameters()))  # the tied one once
    assert profile.param_tensors[0] == 1 and profile.param_tensors[-1] == 0


def test_gpt_head_holds_the_largest_backward_workspace_and_no_block_holds_the_tied_gradient(
        profiles: dict[str, Profile]) -> None:
    profile = profiles["gpt"]
    workspace = profile.workspace_bytes
    head = [layer.name for layer in profile.layers].index("lm_head")
    logits = profile.layers[head].output_bytes
    # the loss's backward holds gradients the size of the logits (batch x sequence x vocabulary)
    assert workspace.index(max(workspace)) == head and workspace[head] >= logits
    # in the whole model autograd holds the head's gradient of the tied embedding (4 MB) through every
    # block's backward; a pipeline stage does not, and the profile leaves it out
    (shared,) = profile.shared_params
    blocks = [w for layer, w in zip(profile.layers, workspace) if layer.kind == "Block"]
    assert blocks and max(blocks) < shared.nbytes


def test_gpt_head_is_the_heaviest_layer(profiles: dict[str, Profile]) -> None:
    profile = profiles["gpt"]
    times = [layer.fwd_ms + layer.bwd_ms for layer in profile.layers]
    assert times.index(max(times)) == [layer.name for layer in profile.layers].index("lm_head")


def test_linear_layers_spend_part_of_their_backward_on_their_input_gradients(profiles: dict[str, Profile]) -> None:
    linears = [layer for layer in profiles["mlp"].layers if layer.kind == "Linear"]
    middle = linears[1:-1]
    # the input gradient's matrix product is as large as the weight gradient's: about half (over the middle
    # layers together: one layer's ratio, a median of 5 pairs of ~1 ms steps, swings on a busy 2-core machine)
    share = sum(layer.bwd_input_ms for layer in middle) / sum(layer.bwd_ms for layer in middle)
    assert 0.2 < share < 0.8
    # the first layer's input is the data: its backward computes (almost) only weight gradients, so it spends
    # a far smaller share of it on B than the middle layers do (shares, not times: B's fixed ~0.1 ms of step
    # overhead is as large as a middle layer's whole B on this model, and one busy step tipped the times)
    assert linears[0].bwd_input_ms / linears[0].bwd_ms < 0.5 * share
    embedding = profiles["gpt"].layers[0]
    assert embedding.kind == "Embedding" and embedding.bwd_input_ms < 0.5 * embedding.bwd_ms


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_backward_split_into_b_and_w_costs_about_as_much_as_one_or_somewhat_more(
        profiles: dict[str, Profile], name: str) -> None:
    # measured ~1.1-1.3 on the examples; a median of 5 pairs of ~1-10 ms backwards swings on a busy machine
    assert 0.7 < profiles[name].split_backward_ratio < 3


def test_more_batch_sizes_time_the_layers_at_each_and_leave_the_rest_at_the_largest() -> None:
    mlp = load_model_file(EXAMPLES / "mlp.py")
    fast = {"warmup": 0, "iters": 1, "threads": 1, "processes": 1}
    phases: list[str] = []
    sized = profile_model(mlp, ProfileSettings(batch_size=2, other_batch_sizes=(1,), **fast),
                          lambda phase, done, total: phases.append(phase))
    single = profile_model(mlp, ProfileSettings(batch_size=2, **fast))
    assert sized.batch_size == 2 and sized.batch_sizes == (1, 2) and single.size_times == ()
    (one,) = sized.size_times
    assert one.batch_size == 1 and one.step_ms > 0
    assert len(one.fwd_ms) == len(one.bwd_ms) == len(one.bwd_input_ms) == sized.num_layers
    assert all(ms >= 0 for ms in one.fwd_ms + one.bwd_ms) and sum(one.fwd_ms) > 0 and sum(one.bwd_ms) > 0
    assert all(0 <= ms <= bwd for ms, bwd in zip(one.bwd_input_ms, one.bwd_ms))
    assert "timing at batch size 1" in phases and "timing input gradients at batch size 1" in phases
    # everything else is measured once, at the main size, as without more sizes
    assert [layer.name for layer in sized.layers] == [layer.name for layer in single.layers]
    assert [(layer.cut_bytes, layer.saved_bytes, layer.param_bytes) for layer in sized.layers] == \
        [(layer.cut_bytes, layer.saved_bytes, layer.param_bytes) for layer in single.layers]
    assert sized.input_bytes == single.input_bytes and sized.workspace_bytes == single.workspace_bytes


def test_one_batch_size_is_also_timed_at_its_quarters_and_one_sample() -> None:
    assert [smaller_batch_sizes(size) for size in (1, 2, 3, 4, 8, 16, 32, 64)] == [
        (), (1,), (1,), (1,), (1, 2), (1, 4), (1, 2, 8), (1, 4, 16)]


BATCH_NORMED = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def example_batch(batch_size):
    return torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,))
"""


def test_a_size_the_model_cannot_run_at_is_left_out_with_a_note_and_the_rest_kept(tmp_path) -> None:
    """Batch norm in training mode refuses one sample per channel: the profile keeps its other sizes and says so."""
    (tmp_path / "normed.py").write_text(BATCH_NORMED)
    profile = profile_model(load_model_file(tmp_path / "normed.py"), ProfileSettings(
        batch_size=4, other_batch_sizes=(1, 2), warmup=0, iters=1, threads=1, processes=1))
    assert profile.batch_sizes == (2, 4) and [sized.batch_size for sized in profile.size_times] == [2]
    (problem,) = profile.settings["batch_sizes_not_timed"].values()
    assert list(profile.settings["batch_sizes_not_timed"]) == ["1"]
    assert "raised ValueError while the profiler was timing layers at batch size 1: Expected more than 1 value per " \
           "channel when training" in problem
    notes = [line for line in profile_summary(profile).splitlines() if "not timed" in line]
    assert notes == [f"note: the layers were not timed at batch size 1: {problem}; `planner partition` does not cut a "
                     "global batch into microbatches of that size, and a plan given it reads the nearest measured sizes' "
                     "times"]


def test_a_cpu_profile_is_timed_among_the_processes_asked_for_and_a_gpu_profile_alone() -> None:
    """(`planner profile`'s default, recorded in the profile, is checked in test_cli; the companions in
    test_companions.)"""
    with pytest.raises(ProfileError, match="--processes 2 applies to CPU profiles only"):
        _processes(2, torch.device("cuda"), 1)
    assert _processes(None, torch.device("cuda"), 1) == 1
    assert _processes(None, torch.device("cpu"), 1) == default_cpu_processes(1)
    assert _processes(3, torch.device("cpu"), 1) == 3
    with pytest.raises(ProfileError, match="--processes 2 applies to CPU profiles only"):
        ProfileSettings(device="cuda", processes=2).check()  # before the model file is imported
    ProfileSettings(device="cpu", processes=2).check()
    ProfileSettings(device="auto", processes=2).check()  # decided once the device is known


@gpu_only
def test_on_a_gpu_machine_the_profile_is_measured_on_the_gpu() -> None:
    """The default device is the GPU (what `planner train` uses there): CUDA events time the layers and the
    allocator's peak is the memory and what it holds beyond tensors the libraries' workspaces."""
    profile = profile_model(load_model_file(EXAMPLES / "gpt.py"), ProfileSettings(batch_size=8, iters=20))
    assert profile.device.startswith("cuda") and profile.device_name == torch.cuda.get_device_name()
    assert profile.peak_memory_method == "cuda-allocator"
    assert 0 < profile.library_bytes < 1 << 30  # cuBLAS's workspaces (65 MiB on an H200)
    assert profile.peak_memory_bytes >= 2 * profile.total_param_bytes + max(l.saved_bytes for l in profile.layers)
    assert all(layer.fwd_ms > 0 and layer.bwd_ms > 0 for layer in profile.layers)


FROZEN_MODEL = '''
import torch
from torch import nn


class Tied(nn.Module):
    """An embedding and a head sharing their weight, frozen with the first block, as in fine-tuning."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def build_model() -> nn.Module:
    model = Tied()
    model.embed.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    return model


def example_batch(batch_size: int):
    tokens = torch.randint(0, 64, (batch_size, 8))
    return tokens, tokens


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, 64), target.reshape(-1))
'''


def test_frozen_parameters_are_recorded_apart_and_a_frozen_tie_holds_no_pending_gradient(tmp_path) -> None:
    (tmp_path / "frozen.py").write_text(FROZEN_MODEL)
    profile = profile_model(load_model_file(tmp_path / "frozen.py"),
                            ProfileSettings(batch_size=4, warmup=0, iters=1, threads=1, processes=1))
    names = [layer.name for layer in profile.layers]
    frozen = dict(zip(names, profile.frozen_param_bytes))
    assert frozen["embed"] == 64 * 32 * 4 and frozen["blocks.0"] == (32 * 32 + 32) * 4
    assert frozen["blocks.1"] == 0 and frozen["head"] == 0  # the head's weight is the embedding's, counted there
    (tie,) = profile.shared_params
    assert tie.frozen and set(tie.names) == {"embed.weight", "head.weight"}
    assert dict(zip(names, profile.param_tensors)) == {"embed": 0, "blocks.0": 0, "blocks.1": 2, "head": 0}
    assert profile.trainable_param_bytes == (32 * 32 + 32) * 4
    assert len(profile.forward_workspace_bytes) == len(names)


UNUSED_MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    """A linear layer and a gate the forward never calls on the example batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.gate = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def build_model() -> nn.Module:
    return nn.Sequential(Block(), Block())


def example_batch(batch_size: int):
    return torch.randn(batch_size, 32), torch.randn(batch_size, 32)
'''


def test_a_parameter_the_example_batch_does_not_reach_is_planned_as_training(tmp_path) -> None:
    """The gates get no `.grad` in any profiled step, as experts of a mixture the example batch is not routed to
    would not, while real data reaches them: they are planned with their gradients and optimizer state, not as
    frozen weights (a stage planned short of memory fails; one planned a little over does not); the profile's
    summary names them."""
    (tmp_path / "unused.py").write_text(UNUSED_MODEL)
    profile = profile_model(load_model_file(tmp_path / "unused.py"),
                            ProfileSettings(batch_size=4, warmup=0, iters=1, threads=1, processes=1))
    gate = (32 * 32 + 32) * 4
    assert [layer.name for layer in profile.layers] == ["0", "1"]
    assert not any(profile.frozen_param_bytes) and list(profile.param_tensors) == [4, 4]
    assert profile.trainable_param_bytes == 4 * gate
    # and the profile says so, naming the first of them
    assert profile.settings["no_gradient"] == {"tensors": 4, "bytes": 2 * gate,
                                               "names": ["0.gate.weight", "0.gate.bias", "1.gate.weight"]}
    assert "note: 4 parameter tensors (8.25 KiB: 0.gate.weight, 0.gate.bias, 1.gate.weight, ...) got no gradient " \
           "from the example batch" in profile_summary(profile)


CHECKPOINTED_MODEL = '''
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Checkpointed(nn.Module):
    """Two blocks the forward checkpoints with torch's reentrant variant (transformers 4.x's default)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=REENTRANT)
        return self.head(h)


def build_model() -> nn.Module:
    return Checkpointed()


def example_batch(batch_size: int):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)
'''


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_model_checkpointed_reentrantly_profiles_with_the_split_backward_unmeasured(tmp_path, reentrant: bool) -> None:
    """Zero-bubble schedules cannot train it (planner.profiling.backward_split.ReentrantCheckpointError): their
    costs stay None, and `partition --schedule auto` leaves them out, instead of the profile failing."""
    (tmp_path / "checkpointed.py").write_text(CHECKPOINTED_MODEL.replace("REENTRANT", str(reentrant)))
    profile = profile_model(load_model_file(tmp_path / "checkpointed.py"),
                            ProfileSettings(batch_size=4, warmup=0, iters=1, threads=1, processes=1))
    assert [layer.name for layer in profile.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    if reentrant:
        assert profile.split_backward_ratio is None and not profile.deferred_bytes
    else:
        assert profile.split_backward_ratio is not None and len(profile.deferred_bytes) == 4


def test_a_model_whose_forward_calls_no_submodule_is_one_line_naming_its_file(tmp_path) -> None:
    """A bare nn.Linear has no layers to split between: the error names the model file and what to build instead."""
    (tmp_path / "bare.py").write_text("import torch\n\n\ndef build_model():\n    return torch.nn.Linear(4, 4)\n\n\n"
                                      "def example_batch(batch_size):\n"
                                      "    return torch.randn(batch_size, 4), torch.randn(batch_size, 4)\n")
    with pytest.raises(ModelFileError) as raised:
        profile_model(load_model_file(tmp_path / "bare.py"), ProfileSettings(batch_size=2, iters=1, warmup=0,
                                                                            threads=1, processes=1))
    assert str(raised.value) == (f"{tmp_path / 'bare.py'}: the model's forward calls no submodule, so it cannot be "
                                 "split into layers; build it of submodules that its forward calls (the layers a plan "
                                 "splits between), e.g. an nn.Sequential")
