"""Point-to-point messages between ranks from background threads, delivered into a mailbox.

Each rank has, per peer it sends to, one sender thread with a FIFO queue, and per peer it
receives from, one receiver thread with a FIFO of expected messages; every ordered pair of
ranks (a -> b) has its own two-rank process group, so the messages of one direction are
matched in order (gloo and NCCL alike) and never wait behind the other direction's.

A message is a nested value (`runtime.nested`) whose tensors are sent one by one with
`torch.distributed.send`. Its structure (shapes, dtypes, which tensors require grad and any
non-tensor values) travels once, before the first message that needs it: `describe` turns a value
into a picklable structure with a `TensorSpec` for each tensor, sent as a length and a byte tensor;
the receiver allocates the tensors with `materialize`, receives into them and makes those that
required grad on the sender require grad. Later messages of the same structure send the tensors
only. Received values land in a `Mailbox` under the key the receiver was told to expect; compute
threads wait there, checking for failures while they wait.

A send (gloo and NCCL alike) completes only once the receiver has posted the matching receive. A
receiver thread therefore keeps up to `RECEIVES_AHEAD` receives posted (`torch.distributed.irecv`,
in the channel's order) for the messages whose structure it already knows, so a sender does not
wait for this thread to be scheduled between two messages: on a busy 2-core machine that wait was
0.3-12 ms a message against a 0.06 ms link. Each posted receive has its buffer allocated, so a rank holds
up to two messages a channel beyond those that arrived and are not taken yet (the planner counts them:
`planner.costs.schedule_cost.ahead_terms`, `planner.simulation.simulator.receive_buffers`); a memory
measurement tracking one thread's operations learns of them from `Links.watch_allocations`.

On a GPU (NCCL) each thread sends or receives on a CUDA stream of its own. NCCL's `wait()` does
not block the host: it orders the calling thread's current stream after the transfer, and on the
compute thread's stream a receive posted ahead would hold back every kernel launched after it,
the forwards whose activations the peer needs before it can send that gradient: a deadlock from
three stages up (reasoned from NCCL's semantics: no run on several GPUs has checked this path yet,
only one GPU was ever lent). So a sender waits on the host for the value's kernels (an event the compute
thread recorded when it queued the value) and for its sends to finish; a receiver waits on the
host for its receives, then hands the tensors over marked as used by the compute stream
(`record_stream`, so that the allocator does not give their memory to the next receive while the
compute stream still reads them). Transfers are then timed as on a CPU, from start to finish.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

import torch
import torch.distributed as dist

from runtime.nested import map_leaves, map_tensors, tensors

__all__ = ["TensorSpec", "describe", "specs", "without_flags", "materialize", "Mailbox", "Links", "POLL_S",
           "RECEIVES_AHEAD"]

POLL_S = 0.05  # how often a waiting thread checks for failures (seconds)
RECEIVES_AHEAD = 2  # messages per channel whose receives are posted before the first of them arrives
_STOP = object()


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a message, and whether it requires grad: the sender wants its
    gradient back (the received tensor is made to require grad after its receive completes)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False


def describe(value: Any) -> Any:
    """`value` with each tensor replaced by its `TensorSpec` (picklable; equal for equal shapes, dtypes and
    requires_grad flags)."""
    return map_tensors(lambda t: TensorSpec(tuple(t.shape), t.dtype, t.requires_grad), value)


def specs(structure: Any) -> list[TensorSpec]:
    """The `TensorSpec`s of a structure (`describe`), in `tensors` order."""
    found: list[TensorSpec] = []
    map_leaves(found.append, structure, TensorSpec)
    return found


def without_flags(structure: Any) -> Any:
    """`structure` with every `TensorSpec`'s requires_grad flag off: what its tensors are, not which need gradients."""
    return map_leaves(lambda spec: TensorSpec(spec.shape, spec.dtype), structure, TensorSpec)


def materialize(structure: Any, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """A value of `structure` with empty tensors on `device`, and those tensors in `tensors` order."""
    made: list[torch.Tensor] = []

    def make(spec: TensorSpec) -> torch.Tensor:
        made.append(torch.empty(spec.shape, dtype=spec.dtype, device=device))
        return made[-1]

    return map_leaves(make, structure, TensorSpec), made


def _flag_requires_grad(value: Any, structure: Any) -> None:
    """Make each tensor of `value`, received into `materialize(structure)`'s tensors, require grad where its
    `TensorSpec` says the sender's did (set once the receive is done: the receive writes into the tensor)."""
    for tensor, spec in zip(tensors(value), specs(structure)):
        if spec.requires_grad:
            tensor.requires_grad_()


class Mailbox:
    """Values by key, put by receiver threads and taken by compute threads (thread-safe)."""

    def __init__(self) -> None:
        self._values: dict[Hashable, Any] = {}
        self._changed = threading.Condition()

    def put(self, key: Hashable, value: Any) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def take(self, key: Hashable, check: Callable[[], None]) -> Any:
        """The value under `key`, removed; waits for it, calling `check()` (which may raise) every POLL_S."""
        while True:
            with self._changed:
                if self._changed.wait_for(lambda: key in self._values, timeout=POLL_S):
                    return self._values.pop(key)
            check()

    def has(self, key: Hashable) -> bool:
        """Whether a value is under `key` now (it stays there)."""
        with self._changed:
            return key in self._values

    def clear(self) -> None:
        with self._changed:
            self._values.clear()


@dataclass(frozen=True)
class Expected:
    """A message a receiver thread waits for: its mailbox `key` and its structure.

    `structure`: known (`describe` of the value), `None` (the sender sends it first), or a
    mailbox key (a `Hashable` wrapped in `Later`) where the compute thread will put it.
    """

    key: Hashable
    structure: Any = None


@dataclass(frozen=True)
class Later:
    """A structure the compute thread puts in the mailbox under `key` before the message can come."""

    key: Hashable


class Links:
    """One rank's sender and receiver threads; `groups[(a, b)]` is the process group of messages a -> b."""

    def __init__(self, rank: int, groups: dict[tuple[int, int], Any], mailbox: Mailbox,
                 device: torch.device, check: Callable[[], None]) -> None:
        self.rank, self.groups, self.mailbox, self.device, self.check = rank, groups, mailbox, device, check
        self.error: tuple[str, BaseException, int] | None = None  # the first thread failure: (what, exception, peer)
        self.transfers: deque[tuple[Hashable, float, float]] = deque()  # (tag, start, end) of tagged sends
        # called by receiver threads with the buffers they allocate for a message, before posting its receives
        # (`watch_allocations`: a memory measurement whose tracking is thread-local counts them from then on)
        self._allocated: Callable[[list[torch.Tensor]], None] | None = None
        self._unsent = 0  # values queued by `send` whose sender thread has not finished them
        self._sent = threading.Condition()
        self._outboxes: dict[int, queue.Queue] = {}
        self._inboxes: dict[int, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        for (source, target) in groups:
            if source == rank:
                self._outboxes[target] = self._start(self._send_loop, target, "send to")
            elif target == rank:
                self._inboxes[source] = self._start(self._receive_loop, source, "receive from")

    def _start(self, loop: Callable[[int, queue.Queue], None], peer: int, what: str) -> queue.Queue:
        jobs: queue.Queue = queue.Queue()

        def run() -> None:
            try:
                with self._own_stream():
                    loop(peer, jobs)
            except BaseException as exc:  # reported to the compute thread by `failure`
                if self.error is None:
                    self.error = (f"{what} rank {peer}", exc, peer)

        thread = threading.Thread(target=run, name=f"rank{self.rank}-{what.replace(' ', '-')}-{peer}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return jobs

    def _own_stream(self) -> Any:
        """On a GPU, a context making a new CUDA stream the thread's current one (module docstring)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    def send(self, peer: int, value: Any, with_structure: bool, tag: Hashable | None = None) -> None:
        """Queue `value` for `peer` (never blocks); its structure goes first if `with_structure`. On a GPU,
        the value's kernels are those launched on the caller's current stream so far.

        With a `tag`, the sender thread appends (tag, start, end) to `transfers` when the transfer is
        done (`time.perf_counter()` seconds, from its first send to the return of its last; on a GPU,
        from when the value is ready to when the sends have finished).
        """
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._sent:
            self._unsent += 1
        self._outboxes[peer].put((value, with_structure, tag, ready))

    def wait_sent(self, check: Callable[[], None]) -> None:
        """Wait until every queued value has been sent, calling `check()` (which may raise) every POLL_S."""
        while True:
            with self._sent:
                if self._sent.wait_for(lambda: self._unsent == 0, timeout=POLL_S):
                    return
            check()

    def watch_allocations(self, report: Callable[[list[torch.Tensor]], None] | None) -> None:
        """Have receiver threads call `report(buffers)` with the tensors they allocate for each message from
        now on (None: stop); `planner.profiling.memory.peak_memory_of`'s `other_threads`."""
        self._allocated = report

    def expect(self, peer: int, messages: Iterable[Expected]) -> None:
        """Tell the receiver thread of `peer` which messages come next, in order."""
        inbox = self._inboxes[peer]
        for message in messages:
            inbox.put(message)

    def close(self) -> None:
        """Let idle threads exit (threads blocked in a transfer stay, as daemons)."""
        for jobs in (*self._outboxes.values(), *self._inboxes.values()):
            jobs.put(_STOP)
        deadline = time.monotonic() + 1.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _send_loop(self, peer: int, jobs: queue.Queue) -> None:
        group = self.groups[(self.rank, peer)]
        while (job := jobs.get()) is not _STOP:
            self._send(peer, group, *job)
            job = None  # (as in `_deliver`: a step's last value sent would stay alive until the next one's first)
            with self._sent:
                self._unsent -= 1
                self._sent.notify_all()

    def _send(self, peer: int, group: Any, value: Any, with_structure: bool, tag: Hashable | None,
              ready: Any) -> None:
        """Send one queued value (its structure first if `with_structure`) and record its transfer if tagged."""
        if ready is not None:
            ready.synchronize()
        start = time.perf_counter()
        if with_structure:
            blob = torch.frombuffer(bytearray(pickle.dumps(describe(value))), dtype=torch.uint8)
            dist.send(torch.tensor([blob.numel()], dtype=torch.int64, device=self.device), peer, group=group)
            dist.send(blob.to(self.device), peer, group=group)
        for tensor in tensors(value):
            dist.send(tensor.detach().contiguous(), peer, group=group)
        if ready is not None:  # NCCL's send returns once queued on this thread's stream
            torch.cuda.current_stream(self.device).synchronize()
        if tag is not None:
            self.transfers.append((tag, start, time.perf_counter()))

    def _receive_loop(self, peer: int, jobs: queue.Queue) -> None:
        """Post the expected messages' receives in order, up to RECEIVES_AHEAD at once, and deliver
        each into the mailbox as it completes.

        A message is posted ahead of the one being waited for only if its structure is known now
        (given, or a `Later` key already in the mailbox): finding it out may need the compute thread,
        which may be waiting for the earlier message.
        """
        group = self.groups[(peer, self.rank)]
        posted: deque[tuple[Hashable, Any, Any, list[Any]]] = deque()  # (key, value, structure, works)
        held: Any = None  # the next job, taken from `jobs` but not posted yet
        while True:
            if held is None:
                if not posted:
                    held = jobs.get()
                else:
                    try:
                        held = jobs.get_nowait()
                    except queue.Empty:
                        pass
            if held is _STOP and not posted:
                return
            if held is not None and held is not _STOP and (
                    not posted or (len(posted) < RECEIVES_AHEAD and self._known_now(held))):
                posted.append(self._post(held, peer, group))
                held = None
                continue
            self._deliver(*posted.popleft())

    def _deliver(self, key: Hashable, value: Any, structure: Any, works: list[Any]) -> None:
        """Wait for a posted message's receives and put it in the mailbox. (A function of its own, so that nothing
        of the message stays referenced here once it is delivered: the receive loop's locals, or a receive's work
        object, which holds its tensor, kept a step's last message alive through the optimizer step while the
        thread waited for the next step's messages.)"""
        for work in works:
            work.wait()
        _flag_requires_grad(value, structure)
        if self.device.type == "cuda":  # NCCL's wait orders this thread's stream only
            torch.cuda.current_stream(self.device).synchronize()
            compute = torch.cuda.default_stream(self.device)
            for tensor in tensors(value):
                tensor.record_stream(compute)
        self.mailbox.put(key, (value, structure))

    def _known_now(self, job: Expected) -> bool:
        """Whether `job`'s structure can be had without waiting."""
        if isinstance(job.structure, Later):
            return self.mailbox.has(job.structure.key)
        return job.structure is not None

    def _post(self, job: Expected, peer: int, group: Any) -> tuple[Hashable, Any, Any, list[Any]]:
        """Find out `job`'s structure (waiting for it if need be), allocate its tensors and post their
        receives; returns (key, value, structure, the receives' works)."""
        structure = job.structure
        if isinstance(structure, Later):
            structure = self.mailbox.take(structure.key, self.check)
        elif structure is None:
            length = torch.empty(1, dtype=torch.int64, device=self.device)
            dist.recv(length, peer, group=group)
            blob = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
            dist.recv(blob, peer, group=group)
            structure = pickle.loads(blob.cpu().numpy().tobytes())
        value, buffers = materialize(structure, self.device)
        report = self._allocated
        if report is not None:
            report(buffers)
        return job.key, value, structure, [dist.irecv(buffer, peer, group=group) for buffer in buffers]
