"""The distributed engine under torchrun on CPU (gloo): parameters equal single-device training (interleaved-1f1b
too: v stages per rank), pipedream stashes weights, a failing rank ends every rank; and its pure parts (message
order, set-up checks, a one-process interleaved pipeline)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from planner.files.cluster import make_cluster
from planner.profiling.model_file import default_loss
from planner.planning.partition import partition
from planner.files.plan import Plan
from planner.files.profile import load_profile
from planner.schedules.schedule import (
    ALLREDUCE, BACKWARD, FORWARD, RECV_ACTIVATION, RECV_GRADIENT, SEND_ACTIVATION, SEND_GRADIENT, STEP,
    build_schedule,
)
from engine_worker import deliberate_failure
from runtime.engine import Engine, EngineError, gradient_structure, init_distributed, sent_structure
from runtime.gradients import make_rank_gradient_groups
from runtime.nested import split_batch
from runtime.p2p import TensorSpec, describe
from runtime.stages import split_model
from runtime.worker_exit import Stopped
from runtime_examples import model_file

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "engine_worker.py"
GPT4 = ["transformer.h.2.mlp", "transformer.h.6", "transformer.h.9"]  # the first cut is inside a block
GPT8 = ["transformer.h.1", "transformer.h.3", "transformer.h.4.mlp", "transformer.h.6", "transformer.h.8",
        "transformer.h.10", "transformer.ln_f"]  # the last stage: ln_f and the tied lm_head


def round_robin(ranks: int, chunks: int) -> list[list[int]]:
    """interleaved-1f1b's placement: stage s on rank s mod p."""
    return [[stage % ranks] for stage in range(ranks * chunks)]


def v_shape(ranks: int) -> list[list[int]]:
    """zbv's placement: stage s on rank s, then back up: rank r holds stages r and 2p - 1 - r."""
    return [[stage if stage < ranks else 2 * ranks - 1 - stage] for stage in range(2 * ranks)]


def case(name: str, model: str, splits: list[str], stage_ranks: list[list[int]], schedule: str,
         microbatches: int = 4, batch: int = 8, steps: int = 2, lr: float = 0.1, **more: Any) -> dict[str, Any]:
    return dict(name=name, model=model, splits=splits, stage_ranks=stage_ranks, schedule=schedule,
                microbatches=microbatches, batch=batch, steps=steps, lr=lr, **more)


CASES = {
    2: [case("gpt-1f1b", "gpt", ["transformer.h.6"], [[0], [1]], "1f1b"),
        case("gpt-gpipe", "gpt", ["transformer.h.6"], [[0], [1]], "gpipe", steps=1),
        case("mlp-checkpoint", "mlp", ["6"], [[0], [1]], "1f1b", checkpoint=True),
        case("mlp-pipedream", "mlp", ["6"], [[0], [1]], "pipedream", microbatches=8, batch=16, lr=0.05),
        case("gpt-zb-h1", "gpt", ["transformer.h.6"], [[0], [1]], "zb-h1"),
        case("mlp-interleaved-checkpoint", "mlp", ["2", "6", "10"], round_robin(2, 2), "interleaved-1f1b", chunks=2,
             checkpoint=True),
        case("gpt-interleaved", "gpt", GPT4, round_robin(2, 2), "interleaved-1f1b", chunks=2,
             checkpoint=[False, True, False, False]),  # rank 1: a recomputing stage and a storing one
        case("gpt-zbv", "gpt", GPT4, v_shape(2), "zbv", chunks=2, microbatches=4)],  # rank 0: first and last stage
    3: [case("mlp-2-1-gpipe", "mlp", ["6"], [[0, 1], [2]], "gpipe"),
        case("mlp-2-1-1f1b-checkpoint", "mlp", ["6"], [[0, 1], [2]], "1f1b", checkpoint=[True, False]),
        case("gpt-1-2-1f1b", "gpt", ["transformer.h.6"], [[0], [1, 2]], "1f1b", steps=1),
        case("mlp-plan-2-1-checkpoint", "mlp", [], [[0, 1], [2]], "1f1b", plan="mlp-2-1.plan.json"),
        case("mlp-1-2-pipedream", "mlp", ["6"], [[0], [1, 2]], "pipedream", microbatches=8, batch=16, lr=0.05),
        case("mlp-2-1-zb-h1", "mlp", ["6"], [[0, 1], [2]], "zb-h1")],
    4: [case("gpt-4-1f1b", "gpt", GPT4, [[0], [1], [2], [3]], "1f1b", steps=1),
        case("gpt-4-gpipe-checkpoint", "gpt", GPT4, [[0], [1], [2], [3]], "gpipe", steps=1, checkpoint=True),
        case("mlp-2-2-1f1b", "mlp", ["6"], [[0, 1], [2, 3]], "1f1b"),
        case("gpt-4-zb-h1", "gpt", GPT4, [[0], [1], [2], [3]], "zb-h1", steps=1),
        case("gpt-4x2-interleaved", "gpt", GPT8, round_robin(4, 2), "interleaved-1f1b", chunks=2, steps=1),
        case("mlp-4x2-zbv", "mlp", ["1", "3", "4", "6", "8", "10", "11"], v_shape(4), "zbv", chunks=2, microbatches=8,
             steps=1)],
}
# A case that fails on purpose ends its job (the worker exits 3 after it): one rides last in a job of CASES
FAILING = {3: case("failing-3", "gpt", ["transformer.h.4", "transformer.h.8"], [[0], [1], [2]], "1f1b",
                   fail={"rank": 1, "microbatch": 2, "in": "forward"}),
           2: case("failing-2", "gpt", ["transformer.h.6"], [[0], [1]], "1f1b",
                   fail={"rank": 0, "microbatch": 1, "in": "backward"})}
FLUSH = [(world, c) for world, cases in CASES.items() for c in cases if c["schedule"] != "pipedream"]
PIPEDREAM = [(world, c) for world, cases in CASES.items() for c in cases if c["schedule"] == "pipedream"]


def torchrun_command(world: int, cases: list[dict[str, Any]], out: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run the worker on `world` CPU processes under torchrun (spec in `out`)."""
    spec = out / f"spec-{world}.json"
    spec.write_text(json.dumps({"cases": cases}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(WORKER), str(spec), str(out)]
    return command, env


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of CASES run under torchrun, one job per world size, the jobs started at once: most of a job is
    importing torch in each process or a rank waiting for its neighbour, so together they take less time than
    one after another. A job of FAILING's world size ends with that case and exits non-zero (its log:
    OUT/job-WORLD.log); the others exit 0."""
    out = tmp_path_factory.mktemp("engine")
    replicated_mlp_plan().save(out / "mlp-2-1.plan.json")
    jobs = {}
    for world, cases in CASES.items():
        cases = [{**c, "plan": str(out / c["plan"])} if "plan" in c else c for c in cases]
        command, env = torchrun_command(world, cases + ([FAILING[world]] if world in FAILING else []), out)
        log = (out / f"job-{world}.log").open("w")
        jobs[world] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env), log)
    try:
        for world, (job, log) in jobs.items():
            job.wait(timeout=300)  # a hang (a failing rank that does not end the others) fails here
            log.close()
            assert (job.returncode != 0) == (world in FAILING), (out / f"job-{world}.log").read_text()[-8000:]
    finally:
        for job, _ in jobs.values():
            if job.poll() is None:
                job.terminate()  # torchrun stops its workers
                job.wait(timeout=60)
    return out


def replicated_mlp_plan() -> Plan:
    """The planner's straight 2-stage mlp plan, made 2-1 on 3 ranks with 1f1b, 4 microbatches and recompute on stage 1."""
    plan = partition(load_profile(REPO / "profiles" / "mlp.json"), make_cluster(2), straight=True, schedule="1f1b")
    first, second = plan.stages
    stages = (dataclasses.replace(first, replicas=2, ranks=(0, 1)),
              dataclasses.replace(second, ranks=(2,), recompute=True))
    return dataclasses.replace(plan, stages=stages, schedule="1f1b", microbatches=4)


def load(out: Path, name: str, rank: int) -> dict[str, Any]:
    return torch.load(out / f"{name}.rank{rank}.pt")


def example(name: str, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The seeded model in eval mode and its batch, as the worker makes them."""
    torch.manual_seed(0)
    model = model_file(name).build_model().eval()
    torch.manual_seed(1)
    inputs, target = model_file(name).example_batch(batch)
    return model, inputs, target


def loss_of(name: str) -> Any:
    return model_file(name).loss_fn or default_loss


@pytest.mark.slow
@pytest.mark.parametrize("world, spec", FLUSH, ids=[c["name"] for _, c in FLUSH])
def test_flush_schedules_give_the_parameters_and_losses_of_single_device_training(
        results: Path, world: int, spec: dict[str, Any]) -> None:
    model, inputs, target = example(spec["model"], spec["batch"])
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    expected_losses = []
    for _ in range(spec["steps"]):
        loss = loss_of(spec["model"])(model(inputs), target)
        expected_losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = dict(model.named_parameters())
    last_ranks = spec["stage_ranks"][-1]
    seen: set[str] = set()
    for rank in range(world):
        found = load(results, spec["name"], rank)
        if rank in last_ranks:
            assert found["losses"] == pytest.approx(expected_losses, rel=1e-5)
        else:
            assert found["losses"] == [None] * spec["steps"]
        for name, value in found["params"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{spec['name']} rank {rank} {name}: {m}")
        seen |= found["params"].keys()
    assert seen == set(expected)  # every parameter lives on some rank


def pipedream_reference(spec: dict[str, Any], stash: bool) -> dict[int, dict[str, torch.Tensor]]:
    """Each rank's parameters after PipeDream training, computed here one action at a time.

    Every rank has its own copy of its stage. A forward runs on a deep copy of the rank's
    weights taken then (`stash`) or at its backward (no stashing); the backward's gradient,
    averaged over the stage's replicas, updates the live weights with SGD.
    """
    model, inputs, target = example(spec["model"], spec["batch"])
    stages = split_model(model, spec["splits"])
    replicas = [len(group) for group in spec["stage_ranks"]]
    m = spec["microbatches"]
    chunks, targets = split_batch(inputs, m), split_batch(target, m)
    live: dict[int, nn.Module] = {}
    for step in range(spec["steps"]):
        schedule = build_schedule("pipedream", replicas, m, stage_ranks=spec["stage_ranks"])
        if step == 0:
            live = {p.rank: copy.deepcopy(stages[p.stage]) for p in schedule.programs}
        position = {p.rank: 0 for p in schedule.programs}
        messages: dict[tuple[str, int, int], torch.Tensor] = {}
        flight: dict[tuple[int, int], Any] = {}  # (rank, microbatch) -> (weights copy, input, output)
        pending: dict[int, list[torch.Tensor]] = {}
        arrived: dict[tuple[int, int], dict[int, list[torch.Tensor]]] = {}
        reductions = dict.fromkeys(position, 0)
        progress = True
        while progress:
            progress = False
            for program in schedule.programs:
                rank, last = program.rank, program.stage == len(replicas) - 1
                while position[rank] < len(program.actions):
                    action = program.actions[position[rank]]
                    mb = action.microbatch
                    if action.op == RECV_ACTIVATION:
                        if ("activation", mb, rank) not in messages:
                            break
                        flight[(rank, mb)] = messages.pop(("activation", mb, rank)).requires_grad_()
                    elif action.op == FORWARD:
                        x = flight.pop((rank, mb), chunks[mb])
                        weights = copy.deepcopy(live[rank]) if stash else None
                        output = weights(x) if stash else live[rank](x).detach()
                        flight[(rank, mb)] = (weights, x, output)
                    elif action.op == SEND_ACTIVATION:
                        messages[("activation", mb, action.peer)] = flight[(rank, mb)][2].detach().clone()
                    elif action.op == RECV_GRADIENT:
                        if ("gradient", mb, rank) not in messages:
                            break
                    elif action.op == BACKWARD:
                        weights, x, output = flight.pop((rank, mb))
                        if not stash:  # the weights of now, not those of the forward
                            weights = copy.deepcopy(live[rank])
                            output = weights(x)
                        if last:
                            loss_of(spec["model"])(output, targets[mb]).backward()
                        else:
                            output.backward(messages.pop(("gradient", mb, rank)))
                        pending[rank] = [p.grad for p in weights.parameters()]
                        if x.requires_grad:
                            flight[("sent", rank, mb)] = x.grad
                    elif action.op == SEND_GRADIENT:
                        messages[("gradient", mb, action.peer)] = flight.pop(("sent", rank, mb))
                    elif action.op == ALLREDUCE:
                        group = arrived.setdefault((action.stage, reductions[rank]), {})
                        group.setdefault(rank, pending[rank])
                        if len(group) < replicas[action.stage]:
                            break
                        pending[rank] = [sum(grads) / len(group) for grads in zip(*group.values())]
                        reductions[rank] += 1
                    elif action.op == STEP:
                        with torch.no_grad():
                            for parameter, grad in zip(live[rank].parameters(), pending.pop(rank)):
                                parameter -= spec["lr"] * grad
                    position[rank] += 1
                    progress = True
        assert all(position[p.rank] == len(p.actions) for p in schedule.programs), "reference deadlocked"
    return {rank: {name: p.detach() for name, p in module.named_parameters()} for rank, module in live.items()}


@pytest.mark.slow
def test_the_tied_embeddings_all_reduce_is_timed_apart_from_the_optimizer_step(results: Path) -> None:
    """gpt's wte/lm_head weight lives on both stages: each times its all-reduce (microbatch -1), then the step."""
    for rank in (0, 1):
        ops = load(results, "gpt-1f1b", rank)["ops"]
        tied = [op for op in ops if op[0] == ALLREDUCE and op[1] == -1]
        (step,) = [op for op in ops if op[0] == STEP]
        assert len(tied) == 1 and tied[0][3] <= step[2], f"rank {rank}: {ops}"



@pytest.mark.slow
def test_a_weight_tied_within_one_rank_is_summed_by_autograd_alone(results: Path) -> None:
    """zbv puts gpt's embedding (stage 0) and its tied head (stage 3) both on rank 0: one Parameter there, no
    all-reduce on any rank (the parameters still equal single-device training's: the flush test)."""
    for rank in (0, 1):
        ops = load(results, "gpt-zbv", rank)["ops"]
        assert not [op for op in ops if op[0] == ALLREDUCE], f"rank {rank}: {ops}"


@pytest.mark.slow
def test_an_interleaved_rank_times_every_action_of_each_of_its_stages(results: Path) -> None:
    """gpt on 2 ranks x 2 chunks: rank r runs stages r and r + 2; each op names its stage (sends too, timed in the
    sender threads), and the one tied all-reduce (wte on stage 0, lm_head on stage 3) precedes the optimizer
    step at the STEP of the rank's last stage."""
    microbatches = range(4)
    for rank in (0, 1):
        ops = load(results, "gpt-interleaved", rank)["ops"]
        mine = (rank, rank + 2)

        def stages_of(kind: str) -> list[tuple[int, int]]:
            return sorted((op[4], op[1]) for op in ops if op[0] == kind)

        for kind in (FORWARD, BACKWARD):
            assert stages_of(kind) == [(s, mb) for s in mine for mb in microbatches], f"rank {rank}: {ops}"
        assert stages_of(SEND_ACTIVATION) == [(s, mb) for s in mine if s != 3 for mb in microbatches]
        assert stages_of(SEND_GRADIENT) == [(s, mb) for s in mine if s != 0 for mb in microbatches]
        (tied,) = [op for op in ops if op[0] == ALLREDUCE]
        steps = [op for op in ops if op[0] == STEP]
        assert [op[4] for op in steps] == list(mine) and tied[4] == mine[-1] and tied[3] <= steps[-1][2]


@pytest.mark.slow
@pytest.mark.parametrize("world, spec", PIPEDREAM, ids=[c["name"] for _, c in PIPEDREAM])
def test_pipedream_backward_uses_the_weights_of_its_forward(results: Path, world: int, spec: dict[str, Any]) -> None:
    stashed, unstashed = pipedream_reference(spec, stash=True), pipedream_reference(spec, stash=False)
    differs = False
    for rank in range(world):
        found = load(results, spec["name"], rank)["params"]
        assert found.keys() == stashed[rank].keys()
        for name, value in found.items():
            torch.testing.assert_close(value, stashed[rank][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{spec['name']} rank {rank} {name}: {m}")
            differs |= not torch.allclose(value, unstashed[rank][name], rtol=1e-4, atol=1e-5)
    assert differs, "the case cannot tell stashed weights from the latest ones; make it update between F and B"


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(FAILING))
def test_a_failing_rank_ends_every_rank_with_its_message(results: Path, world: int) -> None:
    fail = FAILING[world]["fail"]
    expected = (f"rank {fail['rank']} (stage {fail['rank']}, microbatch {fail['microbatch']}) failed: "
                f"ValueError: deliberate failure in {fail['in']}")
    output = (results / f"job-{world}.log").read_text()
    for rank in range(world):
        assert f"rank {rank}: EngineError: {expected}" in output, output[-5000:]
        assert not (results / f"{FAILING[world]['name']}.rank{rank}.pt").exists()


# --- without torchrun --------------------------------------------------------------------------------


def test_outside_torchrun_the_engine_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(EngineError, match=r"not started by torchrun .* `torchrun --nproc-per-node N"):
        init_distributed()
    with pytest.raises(EngineError, match="torch.distributed is not initialized"):
        Engine([nn.Linear(2, 2)], "1f1b")


def test_under_nccl_a_local_rank_without_a_gpu_of_its_own_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # e.g. `planner cluster --nproc 2` or a hand-started torchrun job on a one-GPU machine: torch's own error would be
    # a traceback from set_device ("invalid device ordinal")
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1",
                        "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("no device may be set"))
    with pytest.raises(EngineError, match="local rank 1 needs GPU 1 under NCCL, but this machine has 1: start at most 1"):
        init_distributed("nccl")


def test_a_sent_structure_may_lose_a_requires_grad_flag_but_not_gain_one_or_change_shape() -> None:
    """Structures travel once per slot: freezing the sending stage's parameters after the first step keeps the first
    flags (its receiver's gradient is dropped), unfreezing them is refused in one line, as is a new shape."""
    trained, frozen = describe((torch.zeros(2, 3, requires_grad=True),)), describe((torch.zeros(2, 3),))
    assert sent_structure(None, frozen) == frozen and sent_structure(frozen, frozen) == frozen
    assert sent_structure(trained, frozen) == trained
    with pytest.raises(EngineError, match="requires grad now but did not at the first step .* make a new Engine"):
        sent_structure(frozen, trained)
    with pytest.raises(EngineError, match="changed shape or type"):
        sent_structure(trained, describe((torch.zeros(3, 2, requires_grad=True),)))


def test_gradients_come_back_for_the_sent_tensors_that_require_grad_alone() -> None:
    hidden, cos, ids = torch.zeros(2, 3, requires_grad=True), torch.zeros(1, 3), torch.arange(2)
    sent = describe((hidden, cos, ids))
    assert gradient_structure(sent) == [TensorSpec((2, 3), torch.float32), None, None]


@pytest.fixture
def one_process_job(tmp_path: Path) -> Any:
    """A gloo job of one process (this one), torn down after the test."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_one_rank_engine_trains_like_one_device_and_checks_its_arguments(one_process_job: Any) -> None:
    model, inputs, target = example("mlp", 8)
    reference = copy.deepcopy(model)
    expected = loss_of("mlp")(reference(inputs), target)
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    with Engine([model], "gpipe", microbatches=4, checkpoint=True,
                optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1)) as engine:
        assert engine.train_step(inputs, target) == pytest.approx(expected.item(), rel=1e-5)
        with pytest.raises(EngineError, match="a batch of 3 cannot be split into 4 microbatches"):
            engine.train_step(inputs[:3], target[:3])
    assert engine.closed
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], parameter, rtol=1e-5, atol=1e-6)
    with pytest.raises(EngineError, match="the plan has 3 ranks but the job has 1 process: launch with torchrun "
                                          "--nproc-per-node 3"):
        Engine.from_plan(model, replicated_mlp_plan())
    with pytest.raises(EngineError, match=r"stage ranks \[\[0\], \[1\]\] must cover ranks 0..0"):
        Engine([nn.Linear(2, 2), nn.Linear(2, 2)], "1f1b")
    with pytest.raises(EngineError, match="pipedream steps the optimizer after every backward: pass optimizer="):
        Engine([model], "pipedream")
    with pytest.raises(EngineError, match="unknown schedule 'zb'"):
        Engine([model], "zb")


def test_a_stop_by_sigterm_during_a_step_is_worded_as_one_and_notes_the_ranks_gone_before_the_others_heard(
        one_process_job: Any) -> None:
    """`Stopped` (SIGTERM: torchrun's stop, or `kill PID`) raised in a stage is "rank 0 (stage 0, microbatch 0) was
    stopped by SIGTERM", not "failed: Stopped: "; the ranks of this machine already gone then are kept for the
    rank's own line (none here), before it tells the others, who then exit."""

    class StoppedHere(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise Stopped()

    engine = Engine([StoppedHere()], "gpipe", microbatches=2)
    assert engine.gone_at_failure is None
    with pytest.raises(EngineError) as raised:
        engine.train_step(torch.zeros(4, 2), torch.zeros(4, 2))
    assert str(raised.value) == "rank 0 (stage 0, microbatch 0) was stopped by SIGTERM"
    assert isinstance(raised.value.__cause__, Stopped) and engine.gone_at_failure == [] and engine.closed


def test_a_one_rank_interleaved_engine_holds_both_tied_copies_and_trains_like_one_device(one_process_job: Any) -> None:
    """p = 1, v = 2 on gpt: rank 0 runs both stages, which hold the one tied wte/lm_head Parameter (its
    `.grad` sums both uses; the tied group is rank 0 once), messages between them go through its mailbox,
    and stage 0 recomputes while stage 1 stores: two steps equal single-device training."""
    model, inputs, target = example("gpt", 4)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for _ in range(2):
        loss = loss_of("gpt")(reference(inputs), target)
        expected.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with Engine(split_model(model, ["transformer.h.6"]), "interleaved-1f1b", microbatches=2, chunks=2,
                checkpoint=[True, False], loss_fn=loss_of("gpt"),
                optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1)) as engine:
        assert [engine.train_step(inputs, target) for _ in range(2)] == pytest.approx(expected, rel=1e-5)
        assert engine.stages == (0, 1) and [op.stage for op in engine.trace if op.op == STEP] == [0, 1, 0, 1]
        with pytest.raises(EngineError, match=r"rank 0 runs stages \[0, 1\]: use engine.modules\[stage\]"):
            engine.module
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], parameter, rtol=1e-5, atol=1e-6)


def test_an_interleaved_plan_runs_its_chunks_and_a_failure_names_the_stage(one_process_job: Any) -> None:
    """`from_plan` passes the plan's chunks (2 stages on 1 rank); a failure in stage 1 names stage 1."""
    model, inputs, target = example("mlp", 8)
    plan = replicated_mlp_plan()
    first, second = plan.stages
    plan = dataclasses.replace(plan, schedule="interleaved-1f1b", chunks=2, microbatches=4,
                               stages=(dataclasses.replace(first, replicas=1, ranks=(0,)),
                                       dataclasses.replace(second, ranks=(0,), recompute=False)))
    engine = Engine.from_plan(model, plan)
    assert engine.stages == (0, 1) and engine.schedule.name == "interleaved-1f1b"
    deliberate_failure(engine.modules[1], 2, "forward")
    with pytest.raises(EngineError, match=r"^rank 0 \(stage 1, microbatch 2\) failed: ValueError: deliberate "
                                          "failure in forward$"):
        engine.train_step(inputs, target)
    assert engine.closed


def test_ctrl_c_in_a_step_closes_the_engine_and_blames_no_rank(one_process_job: Any) -> None:
    """Ctrl-C reaches every rank: a KeyboardInterrupt is no rank's failure, so none is published for the others
    (it once was: "rank 1 (stage 1, microbatch 2) failed: KeyboardInterrupt: ")."""
    model, inputs, target = example("mlp", 8)
    engine = Engine(split_model(model, ["2"]), "interleaved-1f1b", microbatches=2, chunks=2)
    calls: list[int] = []

    def interrupt(*_: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    engine.modules[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.train_step(inputs, target)
    assert engine.closed and len(calls) == 2
    assert not engine._store.check([engine._prefix + "error"])  # no failure for the other ranks to report


@pytest.mark.parametrize("arguments, message", [
    (dict(stage_ranks=[[0, 1], [2], [0], [1]]), "interleaved-1f1b needs stages of one device each, a whole number "
                                                "of chunks per rank: got 4 stages, chunks=2, replicas [2, 1, 1, 1]"),
    (dict(microbatches=3), "interleaved-1f1b runs microbatches in groups of one per rank: 3 microbatches do not "
                           "divide among 2 ranks; use a multiple of 2"),
    (dict(stage_ranks=[[0], [0], [1], [1]]), "interleaved-1f1b places its stages on ranks [0, 1, 0, 1] "
                                             "(stage_placement), got [[0], [0], [1], [1]]"),
    (dict(), "stage ranks [[0], [1], [0], [1]] must cover ranks 0..0 with 2 stages each (world size 1); launch one "
             "process per rank of the plan"),
    (dict(schedule="1f1b"), "1f1b runs one stage per rank, got chunks=2; chunks are for interleaved-1f1b, zbv"),
])
def test_the_engine_refuses_an_interleaved_pipeline_it_cannot_run_in_one_line(
        one_process_job: Any, arguments: dict[str, Any], message: str) -> None:
    """Several replicas or microbatches that are not a multiple of p: build_schedule's own words, as EngineError."""
    arguments = {"schedule": "interleaved-1f1b", "microbatches": 4, **arguments}
    with pytest.raises(EngineError) as refused:
        Engine([nn.Linear(2, 2) for _ in range(4)], chunks=2, **arguments)
    assert str(refused.value) == message


def test_parameters_that_need_no_gradient_take_part_in_no_gradient_collective(one_process_job: Any) -> None:
    """A frozen parameter (fine-tuning) would otherwise join the replicas' all-reduce with zeros and come out with
    a zero `.grad`, which the optimizer then steps and keeps state for (weight decay moves it)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    groups = make_rank_gradient_groups([[0]], [], {0: model})
    assert [id(parameter) for parameter in groups.replicated] == [id(parameter) for parameter in model[1].parameters()]
