"""Pipeline: gpipe and 1f1b in threads give single-device gradients, follow the schedule and fail cleanly."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from planner.files.cluster import make_cluster
from planner.errors import PlannerError
from planner.profiling.model_file import default_loss
from planner.planning.partition import partition
from planner.files.plan import Plan
from planner.files.profile import load_profile
from planner.schedules.schedule import BACKWARD, FORWARD, build_schedule
from runtime.nested import split_batch
from runtime.pipeline import Pipeline, PipelineError
from runtime.stages import split_model
from runtime_examples import model_file
from tests.conftest import gpu_only

REPO = Path(__file__).resolve().parents[2]
MICROBATCHES = 4
# split points per model and stage count; gpt's 3-stage split cuts inside a block (a residual crosses it)
SPLITS = {
    ("mlp", 2): ["6"], ("mlp", 3): ["4", "8"],
    ("gpt", 2): ["transformer.h.6"], ("gpt", 3): ["transformer.h.2.mlp", "transformer.h.8"],
    ("resnet", 2): ["layer2"], ("resnet", 3): ["layer1.1.conv2", "layer3"],
    ("vgg", 2): ["features.1"], ("vgg", 3): ["features.3", "features.11"],  # stages begin with ReLU(inplace)
}
BATCH = {"mlp": 8, "gpt": 4, "resnet": 8, "vgg": 8}


def fresh(name: str, train: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """A seeded model (eval mode unless `train`) and its example batch."""
    torch.manual_seed(0)
    model = model_file(name).build_model().train(train)
    inputs, target = model_file(name).example_batch(BATCH[name])
    return model, (inputs,), target


def loss_of(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    return model_file(name).loss_fn or default_loss


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def assert_close(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], exact: bool = False) -> None:
    assert expected.keys() == found.keys()
    for name in expected:
        if exact:
            assert torch.equal(found[name], expected[name]), name
        else:
            torch.testing.assert_close(found[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def pipeline_step(name: str, model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                  stages: int, schedule: str = "1f1b", checkpoint: Any = False) -> float:
    """One train_step of `model` split into `stages` stages on the CPU."""
    split = split_model(model, SPLITS[(name, stages)])
    with Pipeline(split, ["cpu"] * stages, schedule, MICROBATCHES, checkpoint, model_file(name).loss_fn) as pipe:
        return pipe.train_step(inputs, target)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet"])
def test_gradients_and_sgd_step_equal_single_device_training(name: str, stages: int, schedule: str) -> None:
    model, inputs, target = fresh(name)
    reference = copy.deepcopy(model)
    expected_loss = loss_of(name)(reference(*inputs), target)
    expected_loss.backward()
    loss = pipeline_step(name, model, inputs, target, stages, schedule)
    assert loss == pytest.approx(expected_loss.item(), rel=1e-5)
    assert_close(gradients(reference), gradients(model))
    for network in (model, reference):
        torch.optim.SGD(network.parameters(), lr=0.1).step()
    assert_close(dict(reference.named_parameters()), dict(model.named_parameters()))


@gpu_only
@pytest.mark.parametrize("name, schedule, checkpoint", [
    ("mlp", "1f1b", False), ("gpt", "1f1b", (True, False)), ("gpt", "zb-h1", False), ("mlp", "gpipe", False),
])
def test_stages_sharing_one_gpu_give_that_gpus_single_device_gradients(name: str, schedule: str,
                                                                       checkpoint: Any) -> None:
    """Two stages on one GPU, each in its own worker thread (kernels of both on the device's default stream), with
    the mini-batch on the CPU: the loss and gradients of one forward and backward of the whole model on that GPU."""
    model, inputs, target = fresh(name)
    model.to("cuda")
    reference = copy.deepcopy(model)
    expected_loss = loss_of(name)(reference(*(x.to("cuda") for x in inputs)), target.to("cuda"))
    expected_loss.backward()
    split = split_model(model, SPLITS[(name, 2)])
    with Pipeline(split, ["cuda", "cuda"], schedule, MICROBATCHES, checkpoint, model_file(name).loss_fn) as pipe:
        loss = pipe.train_step(inputs, target)
    assert loss == pytest.approx(expected_loss.item(), rel=1e-5)
    assert all(parameter.grad.is_cuda for parameter in model.parameters())
    assert_close(gradients(reference), gradients(model))


def test_tied_embedding_gets_both_stages_gradients() -> None:
    model, inputs, target = fresh("gpt")
    split = split_model(model, SPLITS[("gpt", 2)])
    tied = model.lm_head.weight
    assert [shared.stages for shared in split.shared] == [(0, 1)]
    assert any(p is tied for p in split[0].parameters()) and any(p is tied for p in split[1].parameters())
    reference = copy.deepcopy(model)
    loss_of("gpt")(reference(*inputs), target).backward()
    with Pipeline(split, ["cpu", "cpu"], "gpipe", MICROBATCHES, loss_fn=loss_of("gpt")) as pipe:
        pipe.train_step(inputs, target)
    torch.testing.assert_close(tied.grad, reference.lm_head.weight.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(PipelineError, match=r"tied parameter transformer.wte.weight .* stages \[0, 1\]"):
        Pipeline(split_model(copy.deepcopy(model), SPLITS[("gpt", 2)]), ["cpu", "meta"])


@pytest.mark.parametrize("name, stages, checkpoint", [
    ("mlp", 3, True), ("mlp", 3, (False, True, False)), ("gpt", 3, True), ("gpt", 2, (True, False)),
    ("vgg", 3, True), ("vgg", 2, (False, True)),
])
def test_checkpointing_gives_single_device_gradients(name: str, stages: int, checkpoint: Any) -> None:
    model, inputs, target = fresh(name)
    reference = copy.deepcopy(model)
    expected_loss = loss_of(name)(reference(*inputs), target)
    expected_loss.backward()
    loss = pipeline_step(name, model, inputs, target, stages, "1f1b", checkpoint)
    assert loss == pytest.approx(expected_loss.item(), rel=1e-5)
    assert_close(gradients(reference), gradients(model))


@pytest.mark.parametrize("name, checkpoint", [
    ("gpt", (True, True, True)), ("gpt", (False, True, True)), ("resnet", (True, True, True)),
])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_checkpointing_in_training_mode_replays_dropout_and_keeps_batch_norm_statistics(
        name: str, checkpoint: tuple[bool, ...], schedule: str) -> None:
    """Under one seed, the pipeline with and without recomputation draws the same dropout masks."""
    results = []
    for flags in (False, checkpoint):
        model, inputs, target = fresh(name, train=True)
        torch.manual_seed(1)
        loss = pipeline_step(name, model, inputs, target, 3, schedule, flags)
        results.append((loss, gradients(model), {k: v.clone() for k, v in model.named_buffers()}))
    (plain_loss, plain_grads, plain_buffers), (loss, grads, buffers) = results
    assert loss == plain_loss
    assert_close(plain_grads, grads)  # not bitwise: stages add to a tied weight's .grad in either order
    assert_close(plain_buffers, buffers, exact=True)  # running statistics updated once per microbatch


def test_dropout_is_reproducible_under_a_seed_and_differs_across_seeds() -> None:
    losses = []
    for seed in (1, 1, 2):
        model, inputs, target = fresh("gpt", train=True)
        torch.manual_seed(seed)
        losses.append(pipeline_step("gpt", model, inputs, target, 3))
    assert losses[0] == losses[1] != losses[2]


class Recorder(nn.Module):
    """A layer that logs ("forward"/"backward", microbatch) into `log`; column 0 of its input carries the microbatch."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.log = log
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        microbatch = int(x[0, 0])
        self.log.append((FORWARD, microbatch))
        hidden = self.linear(x[:, 1:])
        hidden.register_hook(lambda grad: self.log.append((BACKWARD, microbatch)))
        return torch.cat([x[:, :1], hidden], dim=1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_each_stage_runs_its_schedule_program_in_order(schedule: str, stages: int) -> None:
    microbatches = 6
    logs: list[list[tuple[str, int]]] = [[] for _ in range(stages)]
    model = nn.Sequential(*[Recorder(log) for log in logs])
    inputs = torch.randn(microbatches * 2, 4)
    inputs[:, 0] = torch.arange(microbatches).repeat_interleave(2).float()
    split = split_model(model, [str(index) for index in range(1, stages)])
    with Pipeline(split, None, schedule, microbatches, loss_fn=lambda out, target: out.pow(2).mean()) as pipe:
        pipe.train_step(inputs, torch.zeros(microbatches * 2))
    programs = build_schedule(schedule, [1] * stages, microbatches).programs
    for program, log in zip(programs, logs):
        expected = [(a.op, a.microbatch) for a in program.actions if a.op in (FORWARD, BACKWARD)]
        assert log == expected, f"stage {program.stage}"


class Failing(nn.Module):
    """Identity, except that it raises in the forward (or backward) of one microbatch.

    Calls are counted per grad mode: a checkpointed stage runs its forwards without grad and
    recomputes them with grad, each in microbatch order (gpipe and 1f1b).
    """

    def __init__(self, microbatch: int, where: str, checkpoint: bool) -> None:
        super().__init__()
        self.microbatch, self.where, self.checkpoint = microbatch, where, checkpoint
        self.calls = {True: 0, False: 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        call = self.calls[grad]
        self.calls[grad] += 1
        if call == self.microbatch and self.where == "forward" and grad != self.checkpoint:
            raise ValueError("broken on purpose")
        if call == self.microbatch and self.where == "backward" and grad:
            return _RaiseInBackward.apply(x)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("broken on purpose")


def run_with_deadline(function: Callable[[], Any], seconds: float) -> BaseException | None:
    """Run `function` in a thread; fail the test if it has not returned within `seconds`; its exception."""
    outcome: list[BaseException | None] = [None]

    def target() -> None:
        try:
            function()
        except BaseException as exc:  # handed back to the test
            outcome[0] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"train_step still running after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("where, stage, checkpoint", [
    ("forward", 0, False), ("forward", 1, False), ("forward", 2, True), ("backward", 1, False),
    ("backward", 0, True), ("backward", 2, False),
])
def test_a_failing_stage_raises_pipeline_error_and_leaves_no_thread(
        where: str, stage: int, checkpoint: bool, schedule: str) -> None:
    before = threading.active_count()
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    layers.insert(stage + 1, Failing(2, where, checkpoint))  # stage k is layers k (and Failing when k == stage)
    model = nn.Sequential(*layers)
    starts = [str(index + (index > stage)) for index in range(1, 3)]
    pipe = Pipeline(split_model(model, starts), None, schedule, 4, checkpoint)
    assert threading.active_count() == before + 3
    started = time.monotonic()
    error = run_with_deadline(lambda: pipe.train_step(torch.randn(8, 4), torch.randn(8, 4)), 10)
    assert time.monotonic() - started < 5
    assert isinstance(error, PipelineError) and isinstance(error, PlannerError)
    assert (error.stage, error.microbatch) == (stage, 2)
    assert f"stage {stage}, microbatch 2 failed: ValueError: broken on purpose" in str(error)
    assert isinstance(error.__cause__, ValueError)
    assert threading.active_count() == before
    assert pipe.closed
    with pytest.raises(PipelineError, match="closed"):
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 4))


def test_close_joins_the_workers_and_the_context_manager_closes() -> None:
    before = threading.active_count()
    stages = split_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["1"])
    with Pipeline(stages) as pipe:
        assert threading.active_count() == before + 2
        pipe.train_step(torch.randn(4, 2), torch.randn(4, 2))
        pipe.train_step(torch.randn(4, 2), torch.randn(4, 2))  # workers serve several steps
    assert threading.active_count() == before
    pipe.close()  # again: nothing to do


def test_a_stage_that_cannot_be_set_up_leaves_no_worker_of_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.pipeline

    built = []

    def runner_failing_for_the_second_stage(*args: Any, **kwargs: Any) -> Any:
        if built:
            raise RuntimeError("no room on that device")
        built.append(True)
        return real_runner(*args, **kwargs)

    real_runner = runtime.pipeline.StageRunner
    monkeypatch.setattr(runtime.pipeline, "StageRunner", runner_failing_for_the_second_stage)
    before = {thread.name for thread in threading.enumerate()}
    stages = split_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["1"])
    with pytest.raises(RuntimeError, match="no room"):
        Pipeline(stages)
    assert {thread.name for thread in threading.enumerate()} - before == set()


def test_pipedream_unknown_schedules_and_bad_arguments_are_refused() -> None:
    stages = split_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), ["1"])
    with pytest.raises(PipelineError, match="pipedream schedule .* needs the distributed engine"):
        Pipeline(stages, schedule="pipedream")
    with pytest.raises(PipelineError, match="unknown schedule 'zigzag'"):
        Pipeline(stages, schedule="zigzag")
    with pytest.raises(PipelineError, match="2 stages need 2 devices"):
        Pipeline(stages, ["cpu"])
    with pytest.raises(PipelineError, match="one flag per stage"):
        Pipeline(stages, checkpoint=[True])
    with Pipeline(stages, microbatches=4) as pipe:
        with pytest.raises(PipelineError, match="batch of 3 cannot be split into 4 microbatches"):
            pipe.train_step(torch.randn(3, 2), torch.randn(3, 2))
        with pytest.raises(PipelineError, match="batch in dim 0"):
            pipe.train_step(torch.randn(4, 2), torch.randn(5, 2))


def mlp_plan(**changes: Any) -> Plan:
    """The planner's straight 2-stage plan of the mlp, with `changes` to the plan and its second stage."""
    plan = partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(2), straight=True, schedule="1f1b")
    assert len(plan.stages) == 2
    stage_changes = {k: v for k, v in changes.items() if k in ("replicas", "ranks", "recompute")}
    plan_changes = {k: v for k, v in changes.items() if k not in stage_changes}
    second = dataclasses.replace(plan.stages[1], **stage_changes)
    return dataclasses.replace(plan, stages=(plan.stages[0], second), **plan_changes)


def test_from_plan_uses_the_plan_and_refuses_replicas_and_pipedream() -> None:
    model, inputs, target = fresh("mlp")
    reference = copy.deepcopy(model)
    default_loss(reference(*inputs), target).backward()
    with Pipeline.from_plan(model, mlp_plan(schedule="gpipe", microbatches=2, recompute=True)) as pipe:
        assert (pipe.schedule.name, pipe.microbatches, pipe.checkpoint) == ("gpipe", 2, (False, True))
        pipe.train_step(*inputs, target)
    assert_close(gradients(reference), gradients(model))
    with pytest.raises(PipelineError, match="stage 1 of the plan has 2 replicas: .* distributed engine"):
        Pipeline.from_plan(model, mlp_plan(replicas=2, ranks=(1, 2)))
    with pytest.raises(PipelineError, match="pipedream schedule"):
        Pipeline.from_plan(model, mlp_plan(schedule="pipedream", microbatches=None))
    interleaved = partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(2), schedule="interleaved-1f1b",
                            microbatches=2)
    with pytest.raises(PipelineError, match="interleaved-1f1b runs several stages per device, and the in-process "
                                            "pipeline one: train the plan with `planner train`"):
        Pipeline.from_plan(model, interleaved)


# --- real transformers models (split with torch.export) ----------------------------------------


@pytest.mark.parametrize("model_name, plan_stages, schedule", [
    ("gpt2_tiny", ["gpt.transformer.wte", "gpt.transformer.h.2"], "gpipe"),  # the tied weight on both stages
    ("llama_tiny", ["model.embed_tokens", "model.layers.1", "model.layers.3"], "1f1b"),
])
def test_from_plan_trains_transformers_models_as_one_device_would(model_name: str, plan_stages: list[str],
                                                                   schedule: str) -> None:
    """Pipeline.from_plan on a transformers model: one train_step of 4 microbatches leaves the gradients of the
    whole batch's mean loss (dropout off, so the stages' random streams do not matter)."""
    pytest.importorskip("transformers")
    from real_model_worker import loss_of as real_loss, seeded_batch, seeded_model

    from test_stages import plan_with_splits, planned

    model = seeded_model(model_name)
    inputs, target = seeded_batch(model_name, 8)
    reference = copy.deepcopy(model)
    real_loss(model_name)(reference(*inputs) if isinstance(inputs, tuple) else reference(inputs), target).backward()
    plan = dataclasses.replace(plan_with_splits(planned("mlp", 2), plan_stages), schedule=schedule,
                               microbatches=MICROBATCHES)
    with Pipeline.from_plan(model, plan, example_inputs=split_batch(inputs, MICROBATCHES)[0],
                            loss_fn=real_loss(model_name)) as pipe:
        assert pipe.stages.method == "export"
        pipe.train_step(inputs, target)
    assert_close(gradients(reference), gradients(model))


@pytest.mark.parametrize("model_name, plan_stages, schedule", [
    ("gpt2_tiny", ["gpt.transformer.wte", "gpt.transformer.h.2"], "1f1b"),
    ("llama_tiny", ["model.embed_tokens", "model.layers.1", "model.layers.3"], "gpipe"),
    ("gpt2_tiny", ["gpt.transformer.wte", "gpt.transformer.h.2"], "zb-h1"),
    ("llama_tiny", ["model.embed_tokens", "model.layers.1", "model.layers.3"], "zb-h1"),
])
def test_from_plan_trains_transformers_models_as_one_device_would_under_the_other_schedule(
        model_name: str, plan_stages: list[str], schedule: str) -> None:
    """The test above with the schedules swapped: each model under gpipe and 1f1b, and under zb-h1 (B and W apart)."""
    test_from_plan_trains_transformers_models_as_one_device_would(model_name, plan_stages, schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recomputed_exported_stages_replay_their_dropout(schedule: str) -> None:
    """GPT-2 split by torch.export, dropout on: recomputing stages 0 and 2 in the backward draws the same masks
    as keeping their activations, so the loss is the same and the gradients too."""
    pytest.importorskip("transformers")
    from real_model_worker import model_file as real_model_file

    source = real_model_file("gpt2_tiny")
    torch.manual_seed(0)
    base = source.build_model().train()
    torch.manual_seed(1)
    inputs, target = source.example_batch(8)
    results = []
    for flags in (False, (True, False, True)):
        model = copy.deepcopy(base)
        split = split_model(model, ["gpt.transformer.h.1", "gpt.transformer.h.3.mlp"], (inputs[: 8 // MICROBATCHES],))
        assert split.method == "export"
        torch.manual_seed(5)
        with Pipeline(split, None, schedule, MICROBATCHES, flags, source.loss_fn) as pipe:
            results.append((pipe.train_step((inputs,), target), gradients(model)))
    (plain_loss, plain_grads), (loss, grads) = results
    assert loss == plain_loss
    assert_close(plain_grads, grads)  # not bitwise: two stages add to the tied weight's .grad in either order


def test_an_example_microbatch_of_another_shape_fails_the_step_in_one_line() -> None:
    """Exported stages run at the example's shapes only: the whole batch given as the example is refused before the
    step starts (the pipeline stays usable), naming both shapes."""
    pytest.importorskip("transformers")
    from real_model_worker import loss_of as real_loss, seeded_batch, seeded_model

    from test_stages import plan_with_splits, planned

    model = seeded_model("gpt2_tiny")
    inputs, target = seeded_batch("gpt2_tiny", 8)
    plan = dataclasses.replace(plan_with_splits(planned("mlp", 2), ["gpt.transformer.wte", "gpt.transformer.h.2"]),
                               schedule="1f1b", microbatches=MICROBATCHES)
    with Pipeline.from_plan(model, plan, example_inputs=inputs, loss_fn=real_loss("gpt2_tiny")) as pipe:
        with pytest.raises(PipelineError) as raised:
            pipe.train_step(inputs, target)
        assert not pipe.closed  # refused before any stage ran
    message = str(raised.value)
    assert "\n" not in message and raised.value.stage is None and raised.value.microbatch is None
    assert "[8x12]" in message and "[2x12]" in message
