"""Heartbeats through the job's key-value store: which rank has stopped answering (died, frozen, cut off).

Every rank runs a `Heartbeat` thread that, every `interval_s` seconds, adds 1 to its own counter
`<prefix>beat/<rank>` in the store and reads every other rank's counter. A rank whose counter
has not moved for `timeout_s` seconds (on this rank's clock: no clocks are compared) is missing.
A store that cannot be reached any more (its host process is gone) makes the heartbeat report
that instead. `check()` raises `RankMissing` from the thread that calls it.

Each rank also records "<hostname> <pid>" under `<prefix>host/<rank>`, so that when a connection
drops, `gone()` can tell at once which ranks of this machine have exited (no waiting for the
timeout); ranks on other machines are found by the heartbeat alone.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["Heartbeat", "RankMissing"]


class RankMissing(Exception):
    """A rank stopped answering; `rank` is None when the store itself went away."""

    def __init__(self, message: str, rank: int | None) -> None:
        self.rank = rank
        super().__init__(message)


class Heartbeat:
    """This rank's heartbeat thread over `store` (see the module docstring)."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int, timeout_s: float,
                 interval_s: float = 1.0) -> None:
        if timeout_s <= interval_s:
            raise ValueError(f"the timeout ({timeout_s} s) must be longer than the heartbeat interval ({interval_s} s)")
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.missing: RankMissing | None = None
        self._hosts: dict[int, tuple[str, int]] = {}  # rank -> (hostname, pid), once every rank wrote it
        store.set(f"{prefix}host/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rank{rank}-heartbeat", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise RankMissing if a rank (or the store) stopped answering."""
        if self.missing is not None:
            raise self.missing

    def missing_within(self, wait_s: float) -> RankMissing | None:
        """The rank (or store) found missing, looking for up to `wait_s` seconds; None if none was.

        A collective or transfer that times out after `timeout_s` can end before this thread has
        seen the rank's counter stand still for as long: it sees a change up to `interval_s` late
        and looks again every `interval_s`, so 2 x `interval_s` after such a timeout it knows."""
        deadline = time.monotonic() + wait_s
        while self.missing is None and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        return self.missing

    def gone(self, wait_s: float = 0.0) -> list[int]:
        """Ranks on this machine whose process has exited (or is a zombie), looking again for up to
        `wait_s` seconds while none has (a killed process closes its connections a moment before
        the kernel marks it exited)."""
        here = socket.gethostname()
        deadline = time.monotonic() + wait_s
        while True:
            self._read_hosts()
            found = [r for r, (host, pid) in sorted(self._hosts.items()) if host == here and not _running(pid)]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def _read_hosts(self) -> None:
        """Every rank's (hostname, pid), once all have written theirs (store errors leave it unread)."""
        if self._hosts:
            return
        keys = [f"{self.prefix}host/{r}" for r in range(self.world)]
        try:
            if self.store.check(keys):
                self._hosts = {r: _host_pid(self.store.get(key)) for r, key in enumerate(keys)}
        except Exception:  # the store is gone too: nothing to learn from it
            pass

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.interval_s + 1.0)

    def _loop(self) -> None:
        others = [r for r in range(self.world) if r != self.rank]
        seen = dict.fromkeys(others, -1)
        changed = dict.fromkeys(others, time.monotonic())
        while not self._stop.is_set():
            try:
                self.store.add(f"{self.prefix}beat/{self.rank}", 1)
                counts = {r: self.store.add(f"{self.prefix}beat/{r}", 0) for r in others}
            except Exception as exc:  # the store's host is gone (or the network to it)
                if not self._stop.is_set():
                    self.missing = RankMissing(f"lost the job's key-value store ({type(exc).__name__}: {exc}); "
                                               "the process that hosts it (torchrun's agent, or rank 0) is gone",
                                               None)
                return
            now = time.monotonic()
            for r, count in counts.items():
                if count != seen[r]:
                    seen[r], changed[r] = count, now
                elif now - changed[r] > self.timeout_s:
                    self.missing = RankMissing(f"rank {r} stopped answering: no heartbeat for "
                                               f"{now - changed[r]:.0f} s (timeout {self.timeout_s:g} s)", r)
                    return
            self._stop.wait(self.interval_s)


def _host_pid(entry: bytes) -> tuple[str, int]:
    host, pid = entry.decode().rsplit(" ", 1)
    return host, int(pid)


def _running(pid: int) -> bool:
    """True if process `pid` exists and is not a zombie (exited, not yet reaped by its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")
