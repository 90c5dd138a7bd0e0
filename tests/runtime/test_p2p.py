"""p2p: describe/materialize round trips, the Mailbox waits and checks, and Links between two gloo processes."""

from __future__ import annotations

import gc
import pickle
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.nested import tensors
from runtime.p2p import Expected, Later, Links, Mailbox, TensorSpec, describe, materialize
from tests.runtime.gloo_pair import run_gloo_pair

CPU = torch.device("cpu")


def message() -> dict[str, Any]:
    """A nested value with tensors of several shapes and dtypes and non-tensor leaves."""
    return {
        "hidden": torch.randn(2, 3),
        "pair": (torch.arange(4, dtype=torch.int64), "tag", [None, torch.tensor(1.5, dtype=torch.float64)]),
        "mask": torch.ones(2, 1, 5, dtype=torch.bool),
        "count": 3,
        "empty": torch.zeros(0, 7, dtype=torch.float16),
    }


# --- describe / materialize -----------------------------------------------------------------------


def test_describe_replaces_each_tensor_by_its_shape_and_dtype() -> None:
    value = message()
    structure = describe(value)
    assert structure["hidden"] == TensorSpec((2, 3), torch.float32)
    assert structure["pair"] == (TensorSpec((4,), torch.int64), "tag", [None, TensorSpec((), torch.float64)])
    assert structure["mask"] == TensorSpec((2, 1, 5), torch.bool)
    assert structure["count"] == 3
    assert structure["empty"] == TensorSpec((0, 7), torch.float16)
    assert tensors(structure) == []


def test_describe_is_equal_for_equal_shapes_dtypes_and_flags_and_differs_otherwise() -> None:
    assert describe(message()) == describe(message())  # other values, same shapes
    assert describe((torch.zeros(2, 3),)) != describe((torch.zeros(3, 2),))
    assert describe((torch.zeros(2, 3),)) != describe((torch.zeros(2, 3, dtype=torch.float64),))
    assert describe((torch.zeros(2), "a")) != describe((torch.zeros(2), "b"))
    assert describe([torch.zeros(2)]) != describe((torch.zeros(2),))
    assert describe((torch.zeros(2, requires_grad=True),)) == (TensorSpec((2,), torch.float32, True),)
    assert describe((torch.zeros(2, requires_grad=True),)) != describe((torch.zeros(2),))


def test_describe_is_picklable() -> None:
    structure = describe(message())
    assert pickle.loads(pickle.dumps(structure)) == structure


def test_materialize_round_trip_keeps_structure_shapes_dtypes_and_other_leaves() -> None:
    value = message()
    made, buffers = materialize(describe(value), CPU)
    assert describe(made) == describe(value)
    assert made["pair"][1] == "tag" and made["pair"][2][0] is None and made["count"] == 3
    assert isinstance(made["pair"], tuple) and isinstance(made["pair"][2], list)
    assert [t.device for t in buffers] == [CPU] * 5


def test_materialize_keeps_a_named_tuple() -> None:
    from test_nested import Pair

    value, made = materialize(describe(Pair(torch.zeros(2, 3), torch.ones(2))), torch.device("cpu"))
    assert type(value) is Pair and value.ids.shape == (2, 3)
    assert len(made) == 2 and made[0] is value.ids and made[1] is value.mask


def test_materialize_returns_its_tensors_in_tensors_order() -> None:
    value = message()
    made, buffers = materialize(describe(value), CPU)
    assert [id(t) for t in buffers] == [id(t) for t in tensors(made)]
    for buffer, original in zip(buffers, tensors(value)):  # filling the buffers in order rebuilds the value
        buffer.copy_(original)
    for found, original in zip(tensors(made), tensors(value)):
        assert torch.equal(found, original)


def test_materialize_of_a_structure_without_tensors() -> None:
    made, buffers = materialize(("a", [1, None], {"k": 2.0}), CPU)
    assert made == ("a", [1, None], {"k": 2.0}) and buffers == []


# --- Mailbox ----------------------------------------------------------------------------------------


def never_fails() -> None:
    return None


class FailAfter:
    """A check that raises on its `calls`-th call."""

    def __init__(self, calls: int) -> None:
        self.calls, self.count = calls, 0

    def __call__(self) -> None:
        self.count += 1
        if self.count >= self.calls:
            raise RuntimeError(f"peer failed (check {self.count})")


def take_failing(box: Mailbox, key: Any, calls: int) -> BaseException:
    """What `box.take(key)` raises with a check that fails on its `calls`-th call (a take that never checks fails)."""
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            box.take(key, FailAfter(calls))
        except RuntimeError as exc:  # the test looks at it
            raised.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "take did not return: check was not called while waiting"
    assert len(raised) == 1
    return raised[0]


def test_take_returns_a_value_already_there_and_removes_it() -> None:
    box = Mailbox()
    box.put(("activation", 0), "value")
    assert box.take(("activation", 0), never_fails) == "value"
    assert "peer failed" in str(take_failing(box, ("activation", 0), 2))


def test_take_waits_for_a_value_put_by_another_thread() -> None:
    box = Mailbox()
    started = threading.Event()

    def put_later() -> None:
        started.wait()
        time.sleep(0.1)
        box.put("key", [torch.ones(2)])

    thread = threading.Thread(target=put_later)
    thread.start()
    started.set()
    value = box.take("key", never_fails)
    thread.join()
    assert torch.equal(value[0], torch.ones(2))
    assert "peer failed" in str(take_failing(box, "key", 1))  # taken: gone


def test_take_only_returns_its_own_key() -> None:
    box = Mailbox()
    box.put("other", 1)
    box.put("mine", 2)
    assert box.take("mine", never_fails) == 2
    assert box.take("other", never_fails) == 1


def test_take_calls_check_while_waiting_and_propagates_its_exception() -> None:
    box = Mailbox()
    raised = take_failing(box, "never", 3)
    assert isinstance(raised, RuntimeError) and str(raised) == "peer failed (check 3)"


def test_clear_drops_every_value() -> None:
    box = Mailbox()
    box.put("a", 1)
    box.clear()
    assert "peer failed" in str(take_failing(box, "a", 1))


# --- Links over a real two-rank gloo group ---------------------------------------------------------


def activation(seed: int) -> dict[str, Any]:
    """A message of one structure (other values per seed): dtypes, a 0-d, an empty and a non-contiguous tensor."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(3, 2, generator=generator).requires_grad_(),  # the sender wants its gradient back
        "meta": ("tag", 4),
        "ids": [torch.randint(0, 100, (3,), generator=generator), None],
        "mask": torch.rand(3, 4, generator=generator) > 0.5,
        "half": torch.randn(3, generator=generator).half(),
        "step": torch.tensor(seed),
        "empty": torch.zeros(0, 5),
        "transposed": torch.randn(4, 3, generator=generator).t(),
    }


def _freed(ref: weakref.ref) -> bool:
    """Whether the tensor `ref` points to is freed within a second (the caller has dropped it)."""
    deadline = time.monotonic() + 1.0
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return ref() is None


def _links_worker(rank: int, store_path: str, out_dir: str) -> None:
    """Rank 0 sends seven activations to rank 1 (the first with its structure); rank 1 sends a gradient back."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        groups = {(0, 1): dist.new_group([0, 1]), (1, 0): dist.new_group([0, 1])}
        box = Mailbox()
        links: Links | None = None

        def check() -> None:
            if links is not None and links.error is not None:
                raise RuntimeError(f"{links.error[0]}: {links.error[1]!r}")

        links = Links(rank, groups, box, CPU, check)
        result: dict[str, Any] = {}
        if rank == 0:
            first, second, third, *more = (activation(seed) for seed in range(7))
            links.send(1, first, with_structure=True)
            links.send(1, second, with_structure=False)
            links.send(1, third, with_structure=False)
            for value in more:  # received more than RECEIVES_AHEAD at a time
                links.send(1, value, with_structure=False)
            links.expect(1, [Expected("gradient", [TensorSpec((3, 2), torch.float32), None])])
            result["sent"] = [first, second, third, *more]
            result["gradient"] = box.take("gradient", check)
            last = torch.randn(1000)  # once sent and dropped here, nothing of the sender thread's keeps it
            links.send(1, [last], with_structure=False)
            links.wait_sent(check)
            sent_ref = weakref.ref(last)
            del last
            result["sender_freed"] = _freed(sent_ref)
        else:
            reported: list[list[torch.Tensor]] = []  # the buffers the receiver thread allocated, per message
            links.watch_allocations(reported.append)
            links.expect(0, [Expected("first", None), Expected("second", Later("second structure"))])
            first, structure = box.take("first", check)
            box.put("second structure", structure)  # as the engine does once it knows the structure
            links.expect(0, [Expected("third", structure)] + [Expected(("more", i), structure) for i in range(4)])
            result["received"] = [(first, structure), box.take("second", check), box.take("third", check)]
            result["received"] += [box.take(("more", i), check) for i in range(4)]
            links.watch_allocations(None)
            result["reported"] = [len(found) == len(tensors(value)) and all(a is b for a, b in zip(found, tensors(value)))
                                  for found, (value, _) in zip(reported, result["received"])] + [len(reported)]
            links.send(0, [first["x"] * -1], with_structure=False)
            links.expect(0, [Expected("last", [TensorSpec((1000,), torch.float32)])])
            last, _ = box.take("last", check)  # once taken and dropped here, nothing of the receiver thread's keeps it
            taken_ref = weakref.ref(last[0])
            del last
            result["receiver_freed"] = _freed(taken_ref)
        links.close()
        result["error"] = None if links.error is None else repr(links.error)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_links_deliver_nested_values_with_and_without_their_structure(tmp_path: Path) -> None:
    run_gloo_pair(_links_worker, tmp_path)
    sender = torch.load(tmp_path / "rank0.pt", weights_only=False)
    receiver = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert sender["error"] is None and receiver["error"] is None
    sent = sender["sent"]
    assert len(sent) == len(receiver["received"]) == 7
    # `watch_allocations` was told, per message, of exactly the tensors it was received into (`reported`, in order)
    assert receiver["reported"] == [True] * 7 + [7]
    # a step's last message is not kept alive by the threads once sent and once taken (they wait for the next)
    assert sender["sender_freed"] and receiver["receiver_freed"]
    for original, (value, structure) in zip(sent, receiver["received"]):
        assert structure == describe(original)
        assert value["meta"] == ("tag", 4) and value["ids"][1] is None and isinstance(value["ids"], list)
        assert describe(value) == describe(original)
        for found, expected in zip(tensors(value), tensors(original)):
            assert torch.equal(found, expected)
            assert found.requires_grad == expected.requires_grad  # set once received: x alone
    gradient, structure = sender["gradient"]
    assert structure == [TensorSpec((3, 2), torch.float32), None]
    assert gradient[1] is None
    assert torch.equal(gradient[0], -sent[0]["x"])
