"""`planner cluster`: measure the links of the machines a torchrun job runs on and write a cluster file.

    torchrun --standalone --nproc-per-node 2 -m runtime.cluster_probe --out clusters/here.json
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT -m runtime.cluster_probe --out c.json

One process per device (GPUs with NCCL, CPU processes with gloo), ranks grouped by host into nodes
(each host must run the same number of ranks, contiguously). For each level, rank 0 and one peer
(rank 1 within a node; the first rank of the second node between nodes) bounce messages of
several sizes back and forth, twice: through the runtime's own path (`runtime.p2p.Links`: the
compute thread queues the message, a sender thread sends it, a receiver thread delivers it into
the mailbox the peer's compute thread takes it from) and with plain `send`/`recv`. Half a round
trip is one message's time, the median of `--trials` after a warm-up, and
`planner.profiling.links.fit_link` fits latency + bytes / bandwidth to each. The levels the file
gives the planner are the runtime path's: what a pipeline stage waits for a message to arrive
(on the 2-core CPU machine its latency is about twice the plain link's). The plain link's fit is
kept under `measured.link_only`.
The all-reduce over every rank is timed at several sizes next to the ring formula's prediction
from the fitted links (`costs.schedule_cost.allreduce_s`); the formula's terms fitted to those times
(`fit_allreduce`) become the outermost level's `allreduce_bandwidth_Bps` and `allreduce_latency_s`,
which price the plans' all-reduces (gloo's on one CPU host took 1.5-2.7x the links' ring; where the
times give no fit, the links' terms price them and the command says so), and each GPU's memory is read
(CPU: none, so plans are not memory-limited). Rank 0 writes the file: the cluster's `levels` and
`memory_bytes` (what `planner partition --cluster` reads) and `measured` (every timing, the
backend, device, hosts and threads).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from planner.costs.schedule_cost import allreduce_s
from planner.errors import PlannerError
from planner.files.cluster import cluster_from_dict
from planner.files.fileformat import write_atomically
from planner.profiling.links import fit_allreduce, fit_link
from runtime.engine import init_distributed
from runtime.p2p import Expected, Links, Mailbox, describe
from runtime.worker_exit import exit_worker

__all__ = ["SIZES_BYTES", "measure", "main"]

SIZES_BYTES = (4, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24, 1 << 26)  # 4 B .. 64 MiB
QUICK_SIZES_BYTES = (4, 1 << 14, 1 << 20, 1 << 24)  # the largest outlasts a busy machine's scheduling delays (~2 ms)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime.cluster_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the cluster file to write (JSON)")
    parser.add_argument("--trials", type=int, default=10, help="timed messages per size (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="four sizes up to 16 MiB instead of eight up to 64 MiB")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    return parser.parse_args(argv)


def _nodes(hosts: Sequence[str]) -> tuple[int, int]:
    """(ranks per node, nodes) of the ranks' hostnames; PlannerError unless every host runs the
    same number of contiguous ranks."""
    runs: list[list[str]] = []
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1].append(host)
        else:
            runs.append([host])
    sizes = {len(run) for run in runs}
    if len({run[0] for run in runs}) != len(runs) or len(sizes) != 1:
        raise PlannerError(f"ranks by host {list(hosts)}: every host must run the same number of contiguous "
                           "ranks (torchrun --nproc-per-node N on each)")
    return len(runs[0]), len(runs)


def _one_way_s(rank: int, peer: int, nbytes: int, trials: int, device: torch.device) -> float | None:
    """Rank 0: the median half round trip of `nbytes` to `peer` and back, seconds; None elsewhere."""
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    times = []
    for _ in range(trials + 1):
        if rank == 0:
            start = time.perf_counter()
            dist.send(buffer, peer)
            dist.recv(buffer, peer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) / 2.0)
        elif rank == peer:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
    return statistics.median(times[1:]) if rank == 0 else None


def _runtime_one_way_s(links: Links | None, peer: int, nbytes: int, trials: int, device: torch.device) -> float | None:
    """Rank 0: the median half round trip of `nbytes` to `peer` and back through the runtime's `Links`
    (from queuing the message in this thread to taking the reply from the mailbox), seconds; None elsewhere.
    `links`: this rank's links with the other end (None on ranks that take no part)."""
    if links is None:
        return None
    rank = links.rank
    other = peer if rank == 0 else 0
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    links.expect(other, [Expected(("bounce", nbytes, trial), describe(buffer)) for trial in range(trials + 1)])
    times = []
    for trial in range(trials + 1):
        if rank == 0:
            start = time.perf_counter()
            links.send(peer, buffer, with_structure=False)
            links.mailbox.take(("bounce", nbytes, trial), links.check)
            if device.type == "cuda":  # under NCCL a receive's wait only orders the stream: wait for the data
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) / 2.0)
        else:
            value, _ = links.mailbox.take(("bounce", nbytes, trial), links.check)
            links.send(0, value, with_structure=False)
    links.wait_sent(links.check)
    return statistics.median(times[1:]) if rank == 0 else None


def _links_with(rank: int, peer: int, device: torch.device) -> Links | None:
    """Links between rank 0 and `peer` as the engine makes them (a process group per direction);
    every rank takes part in creating the groups, only those two get links."""
    groups = {(0, peer): dist.new_group([0, peer]), (peer, 0): dist.new_group([0, peer])}
    if rank not in (0, peer):
        return None

    def check() -> None:
        if links.error is not None:
            what, error, _ = links.error
            raise PlannerError(f"{what} failed: {type(error).__name__}: {error}")

    links = Links(rank, groups, Mailbox(), device, check)
    return links


def _allreduce_s(nbytes: int, trials: int, device: torch.device) -> float:
    """The median time of an all-reduce of `nbytes` over every rank, seconds (each after a barrier)."""
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    times = []
    for _ in range(trials + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(sizes: Sequence[int], trials: int, device: torch.device) -> dict[str, Any] | None:
    """Every rank measures (a collective); rank 0 returns the cluster file's body, the others None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    per_node, nodes = _nodes(hosts)
    if world < 2:
        raise PlannerError("measuring links needs two or more processes: run it with --nproc 2 or more")
    pairs = ([("node", 1)] if per_node >= 2 else []) + ([("cluster", per_node)] if nodes >= 2 else [])
    sizes = [4 * max(size // 4, 1) for size in sizes]
    timings: dict[str, list[list[float]]] = {}
    runtime_timings: dict[str, list[list[float]]] = {}
    for name, peer in pairs:
        found = [_one_way_s(rank, peer, size, trials, device) for size in sizes]
        dist.barrier()
        links = _links_with(rank, peer, device)
        through_links = [_runtime_one_way_s(links, peer, size, trials, device) for size in sizes]
        if links is not None:
            links.close()
        dist.barrier()
        timings[name] = [[size, seconds] for size, seconds in zip(sizes, found)] if rank == 0 else []
        runtime_timings[name] = [[size, seconds] for size, seconds in zip(sizes, through_links)] if rank == 0 else []
    reductions = [_allreduce_s(size, trials, device) for size in sizes]
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    memories: list[Any] = [None] * world
    dist.all_gather_object(memories, memory)
    if rank != 0:
        return None
    levels, link_only = [], []
    for name, _ in pairs:
        size = per_node if name == "node" else nodes
        for found, into in ((runtime_timings[name], levels), (timings[name], link_only)):
            latency, bandwidth = fit_link([s for s, _ in found], [t for _, t in found])
            into.append({"name": name, "size": size, "bandwidth_Bps": bandwidth, "latency_s": latency})
    slowest = levels[-1]
    predicted = [float(allreduce_s(size, world, slowest["bandwidth_Bps"], slowest["latency_s"])) for size in sizes]
    # the all-reduce spans every rank, so the outermost level's link: price its all-reduces by this fit
    try:
        slowest["allreduce_latency_s"], slowest["allreduce_bandwidth_Bps"] = fit_allreduce(sizes, reductions, world)
    except PlannerError:  # times that do not grow with the size: the links' terms price them (`summary` says so)
        pass
    return {
        "levels": levels,
        "memory_bytes": min(memories) if all(m is not None for m in memories) else None,
        "measured": {
            "by": "planner cluster", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "backend": dist.get_backend(), "device": str(device), "threads": torch.get_num_threads(),
            "hosts": sorted(set(hosts)), "world_size": world, "trials": trials,
            "one_way_s": runtime_timings,
            "link_only": {"levels": link_only, "one_way_s": timings},
            "allreduce_s": [[size, found, guess] for size, found, guess in zip(sizes, reductions, predicted)],
        },
    }


def summary(body: dict[str, Any]) -> str:
    """A few lines for the terminal: each level's fit, and all-reduce measured against the ring formula."""
    members = ["ranks"] + [f"{level['name']}s" for level in body["levels"][:-1]]  # what each level groups
    lines = [f"{level['name']}: {level['size']} {member}, {level['bandwidth_Bps'] / 1e9:.3g} GB/s + "
             f"{level['latency_s'] * 1e6:.3g} us per message through the runtime (the link alone: "
             f"{alone['bandwidth_Bps'] / 1e9:.3g} GB/s + {alone['latency_s'] * 1e6:.3g} us)"
             for level, member, alone in zip(body["levels"], members, body["measured"]["link_only"]["levels"])]
    lines.append("all-reduce over every rank (measured / ring formula from the links): " + ", ".join(
        f"{size / 1e6:.3g} MB {found * 1e3:.3g} ms (x{found / guess:.2f})"
        for size, found, guess in body["measured"]["allreduce_s"]))
    outer = body["levels"][-1]
    if "allreduce_bandwidth_Bps" in outer:
        lines.append(f"{outer['name']} all-reduces priced as a ring at {outer['allreduce_bandwidth_Bps'] / 1e9:.3g} "
                     f"GB/s + {outer['allreduce_latency_s'] * 1e6:.3g} us per message (fitted to the times above)")
    else:
        lines.append(f"{outer['name']} all-reduces priced by the link's terms: their times above do not grow with the "
                     "size, so no fit; measure again on a quieter machine")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, write the cluster file on rank 0; the exit status (a PlannerError: one line on stderr, 1)."""
    args = parse_args(argv)
    if args.trials < 1:
        print(f"error: --trials must be at least 1, got {args.trials}", file=sys.stderr)
        return 1
    try:
        rank, _, device = init_distributed(args.backend)
        body = measure(QUICK_SIZES_BYTES if args.quick else SIZES_BYTES, args.trials, device)
        if body is not None:
            cluster_from_dict(body, args.out)  # what partition --cluster will read must load
            path = Path(args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            text = (json.dumps(body, indent=1) + "\n").encode()
            write_atomically(path, lambda handle: handle.write(text))
            print(summary(body))
            print(f"wrote {path}")
        dist.barrier()
        dist.destroy_process_group()
    except PlannerError as exc:
        print(f"error: rank {os.environ.get('RANK', '?')}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_worker(main())
