"""Tests of runtime/liveness.py: heartbeats in an in-process store name a silent rank, and not a live one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import torch.distributed as dist

from runtime.liveness import Heartbeat, RankMissing

TIMEOUT_S = 0.5
INTERVAL_S = 0.1


def test_a_rank_whose_counter_stands_still_is_named_once_the_timeout_passed() -> None:
    store = dist.HashStore()
    watcher = Heartbeat(store, "job/", rank=0, world=2, timeout_s=TIMEOUT_S, interval_s=INTERVAL_S)
    try:
        assert watcher.missing_within(0.0) is None  # nobody has been silent for the timeout yet
        started = time.monotonic()
        found = watcher.missing_within(TIMEOUT_S + 2 * INTERVAL_S + 5.0)
        assert isinstance(found, RankMissing) and found.rank == 1, found
        assert str(found).startswith("rank 1 stopped answering: no heartbeat for "), str(found)
        assert time.monotonic() - started >= TIMEOUT_S * 0.9  # not before the timeout (its first look starts it)
        try:
            watcher.check()
        except RankMissing as raised:
            assert raised is found
        else:
            raise AssertionError("check() did not raise what missing_within returned")
    finally:
        watcher.close()


def test_ranks_that_beat_are_not_missing_and_one_that_freezes_is() -> None:
    store = dist.HashStore()
    zero = Heartbeat(store, "job/", rank=0, world=2, timeout_s=TIMEOUT_S, interval_s=INTERVAL_S)
    one = Heartbeat(store, "job/", rank=1, world=2, timeout_s=TIMEOUT_S, interval_s=INTERVAL_S)
    try:
        assert zero.missing_within(3 * TIMEOUT_S) is None and one.missing_within(0.0) is None
        one.close()  # rank 1 freezes: its counter stops
        found = zero.missing_within(TIMEOUT_S + 2 * INTERVAL_S + 5.0)
        assert found is not None and found.rank == 1, found
    finally:
        zero.close()
        one.close()


def test_gone_names_the_ranks_of_this_machine_whose_process_exited() -> None:
    store = dist.HashStore()
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # reaped: its pid is free
    store.set("job/host/1", f"{socket.gethostname()} {ended.pid}")
    store.set("job/host/2", f"{socket.gethostname()} {os.getpid()}")  # alive: this process
    store.set("job/host/3", f"another-machine {ended.pid}")  # not on this machine: the heartbeat's to find
    watcher = Heartbeat(store, "job/", rank=0, world=4, timeout_s=60.0, interval_s=INTERVAL_S)
    try:
        assert watcher.gone() == [1]
    finally:
        watcher.close()


def test_missing_within_returns_none_once_the_heartbeat_stopped() -> None:
    store = dist.HashStore()
    watcher = Heartbeat(store, "job/", rank=0, world=2, timeout_s=60.0, interval_s=INTERVAL_S)
    watcher.close()
    started = time.monotonic()
    assert watcher.missing_within(30.0) is None
    assert time.monotonic() - started < 5.0  # a closed heartbeat will find nothing more: no wait
