"""Measurement conditions that change times (threads per process, cores, malloc settings), and how two differ.

A profile records the conditions it was measured in (`current_conditions`, in
`Profile.settings["conditions"]`); `planner train` gives its workers the same ones where the
machine allows and says what differs otherwise (`differences`), and so does `planner compare`.

On CPU both run with glibc keeping freed memory (`STEADY_MALLOC`: `steady_malloc` for the commands,
`keep_freed_memory` inside a process for the Python API): by default glibc hands large freed blocks
back to the OS and page-faults them in again on the next step; GPipe, which keeps every microbatch's
activations alive at once, then ran 5-10% slower on CPU than its profile predicts, and a profile's
middle mlp layers read 2.8 or 1.4 ms a backward from one profile to the next.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from planner.units import plural

__all__ = ["DEFAULT_RANKS", "STEADY_MALLOC", "CpuReading", "busy_cores", "busy_cores_between", "busy_share",
           "busy_warning", "cgroup_cpu_quota", "cores", "cpu_reading", "current_conditions", "default_cpu_processes", "default_cpu_threads",
           "differences", "keep_freed_memory", "oversubscribed", "profile_load_warning", "steady_malloc",
           "worker_threads"]

STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
# glibc's mallopt parameters for them (malloc.h), and the largest value mallopt takes (a C int): trimming
# above 2 GiB of free heap top is as good as never here
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
_INT_MAX = 2**31 - 1
DEFAULT_RANKS = 2  # processes per machine a CPU profile is measured for, unless --threads says otherwise


def cores(cgroup_root: str = "/sys/fs/cgroup", cgroup_list: str = "/proc/self/cgroup") -> int:
    """CPU cores this process may use: the CPUs of its affinity mask (a cpuset's included), fewer where a cgroup's
    CPU quota allows less time, floor(quota) and at least 1 (`docker run --cpus 2` on a 64-core host: 2)."""
    visible = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root, cgroup_list)
    return visible if quota is None else max(1, min(visible, int(quota)))


def cgroup_cpu_quota(cgroup_root: str = "/sys/fs/cgroup", cgroup_list: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroups allow it, quota / period: the least over its own cgroup and those
    above it, as `cgroup_list` places it under `cgroup_root` (cgroup v2's `cpu.max`, "max" for none; v1's
    `cpu.cfs_quota_us` over `cpu.cfs_period_us`, -1 for none). None where no quota is set or the files cannot be
    read (not Linux)."""
    try:
        lines = Path(cgroup_list).read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        controllers, path = fields[1], fields[2]
        if controllers == "":  # v2's one hierarchy
            quotas += _quotas(Path(cgroup_root), path, _v2_quota)
        elif "cpu" in controllers.split(","):  # v1: a hierarchy mounted per controller list
            quotas += _quotas(Path(cgroup_root) / controllers, path, _v1_quota)
    return min(quotas, default=None)


def _quotas(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas `read` finds in the folder of the cgroup at `path` under `mount` and in those above it, up to
    `mount`. In a container the listed path is the host's, and the mount shows the container's own cgroup at its
    top: a path not found under the mount is read as the top."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        folder = mount
    found = (read(each) for each in [folder, *(mount / above for above in folder.relative_to(mount).parents)])
    return [quota for quota in found if quota is not None]


def _v2_quota(folder: Path) -> float | None:
    """cgroup v2: `cpu.max` of `folder` ("QUOTA PERIOD" in microseconds, or "max PERIOD") as CPUs; None for none."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    """cgroup v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` of `folder` as CPUs; None for -1 (none) or no files."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def busy_cores(interval_s: float = 0.2, stat_path: str = "/proc/stat") -> float | None:
    """Cores' worth of CPU time the whole machine spends busy over the next `interval_s` seconds, by the
    kernel's `cpu` line of /proc/stat (every tick but idle and iowait) x os.cpu_count(); None where that
    file cannot be read (not Linux)."""
    try:
        before = _cpu_ticks(stat_path)
        time.sleep(interval_s)
        after = _cpu_ticks(stat_path)
    except (OSError, ValueError, IndexError):
        return None
    return busy_share(before, after) * (os.cpu_count() or 1)


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The busy share of the ticks between two (busy ticks, all ticks) readings: (b1 - b0) / (t1 - t0), 0 when
    no tick passed."""
    ticks = after[1] - before[1]
    return (after[0] - before[0]) / ticks if ticks > 0 else 0.0


def _cpu_ticks(stat_path: str) -> tuple[int, int]:
    """(busy, all) ticks of /proc/stat's `cpu` line (fields: user nice system idle iowait irq softirq steal ...)."""
    with open(stat_path, encoding="ascii") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


@dataclass(frozen=True)
class CpuReading:
    """Seconds at one moment: wall clock, CPU the whole machine has spent busy since boot (/proc/stat), and CPU
    this process and its children alive now have spent (user + system, every thread; /proc/PID/stat)."""

    wall_s: float
    machine_busy_s: float
    own_s: float


def cpu_reading(proc: str = "/proc") -> CpuReading | None:
    """The CpuReading of now; None where /proc cannot be read (not Linux)."""
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
    wall_s = time.monotonic()  # with the machine's reading; the scan of the processes after it takes milliseconds
    try:
        busy_ticks, _ = _cpu_ticks(f"{proc}/stat")
        me = os.getpid()
        own_ticks = 0
        for entry in os.scandir(proc):
            if not entry.name.isdigit():
                continue
            try:
                ppid, ticks = _process_ticks(f"{entry.path}/stat")
            except (OSError, ValueError, IndexError):  # ended meanwhile
                continue
            if int(entry.name) == me or ppid == me:
                own_ticks += ticks
    except (OSError, ValueError, IndexError):
        return None
    return CpuReading(wall_s, busy_ticks * tick_s, own_ticks * tick_s)


def _process_ticks(stat_path: str) -> tuple[int, int]:
    """(parent pid, user + system ticks) of a /proc/PID/stat file (fields 4, 14 and 15; the name in parentheses,
    field 2, may hold spaces)."""
    with open(stat_path, encoding="ascii", errors="replace") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def busy_cores_between(start: CpuReading, end: CpuReading) -> tuple[float, float]:
    """(this process and its children, every other process): cores' worth of CPU each used between two readings,
    CPU s / wall s (own; machine busy less own, at least 0); (0, 0) when no time passed."""
    wall_s = end.wall_s - start.wall_s
    if wall_s <= 0:
        return 0.0, 0.0
    own_s = end.own_s - start.own_s
    return own_s / wall_s, max(0.0, (end.machine_busy_s - start.machine_busy_s - own_s) / wall_s)


def profile_load_warning(conditions: Mapping[str, Any]) -> str | None:
    """The sentence for a CPU profile measured while other processes used at least half a core
    (`conditions["others_busy_cores"]`, with `own_busy_cores`: `busy_cores_between` over its timings), else None.
    Its P processes of T threads each would keep P T cores busy on a quiet machine; where they got fewer (the
    others took the rest), each of its threads ran P T / own of the time, so its times may read up to that
    factor too long; where they got their cores, the others still share the caches and the memory bandwidth
    (a profile taken beside two pytest workers on the 2-core machine predicted 1.28-1.35x the compute that
    training on the quiet machine measured)."""
    others, own = conditions.get("others_busy_cores"), conditions.get("own_busy_cores")
    if others is None or others < 0.5:
        return None
    demand = (conditions.get("processes") or 1) * (conditions.get("threads") or 1)
    how_far = f"up to {demand / own:.2g}x" if own and demand / own >= 1.1 else "somewhat"
    return (f"the profile was measured while other processes used {others:.1f} of its machine's "
            f"{conditions.get('cores')} cores (its own {demand} thread{'s' if demand != 1 else ''} got {own:.1f}): "
            f"its layers may read {how_far} slower than they run on a quiet machine, and plans made from it predict "
            "that (profile again with the machine quiet)")


def busy_warning(busy: float | None, machine_cores: int, processes: int, threads: int,
                 job: str = "training") -> str | None:
    """The sentence `planner train` (`job` "training") or `planner cluster` ("cluster") prints when other processes
    keep at least half a core busy before its job starts (`busy_cores`), else None."""
    if busy is None or busy < 0.5:
        return None
    said = (f"{busy:.1f} of this machine's {machine_cores} cores were busy before the job started (other "
            f"processes): ")
    if job == "cluster":
        return said + (f"the {processes} measuring processes share them, so messages and all-reduces may read slower "
                       "than this machine's links are, and plans made with this cluster file will expect that "
                       "(measure again on a quiet machine)")
    return said + (f"training shares them, so CPU work may take longer than predicted, and far longer where "
                   f"their threads and the job's {processes} x {threads} outnumber the cores (two jobs at once on "
                   "2 cores took 13 s for a step of 77 ms)")


def default_cpu_threads(ranks: int = DEFAULT_RANKS) -> int:
    """Threads per process when `ranks` processes share this machine's cores: cores // ranks (at least 1),
    what `planner train` gives each of them."""
    return max(1, cores() // ranks)


def default_cpu_processes(threads: int) -> int:
    """Processes a CPU profile of `threads` threads each is measured among by default: DEFAULT_RANKS, what
    `planner train` starts for a plan of that many ranks, as far as the cores hold them (threads x
    processes <= cores; at least 1). `planner.profiling.companions` runs the others."""
    return max(1, min(DEFAULT_RANKS, cores() // threads))


def worker_threads(profiled: int | None, ranks: int) -> int:
    """Threads for each of `ranks` training processes on this machine: the profile's count where
    the cores allow it (profiled x ranks <= cores), else cores // ranks."""
    fits = profiled is not None and profiled * ranks <= cores()
    return profiled if fits else default_cpu_threads(ranks)


def current_conditions(threads: int, processes: int | None) -> dict[str, Any]:
    """This process's conditions: torch `threads`, the machine's `cores`, the `processes` computing on them
    at once (a training job's ranks on this machine; a CPU profile's companions and itself; None for a GPU
    profile, whose training processes have a device each), and the `malloc` settings of STEADY_MALLOC's
    variables (None where unset)."""
    return {"threads": threads, "cores": cores(), "processes": processes,
            "malloc": {name: os.environ.get(name) for name in STEADY_MALLOC}}


def oversubscribed(conditions: Mapping[str, Any]) -> str | None:
    """"P processes x T threads share C cores (each thread gets C / (P T) of a core)" where the conditions' processes
    x threads exceed their cores (a CPU run or profile), else None (a GPU profile records no processes)."""
    processes, threads, machine = conditions.get("processes"), conditions.get("threads"), conditions.get("cores")
    if not (processes and threads and machine and processes * threads > machine):
        return None
    return (f"{plural(processes, 'process', 'processes')} x {plural(threads, 'thread')} share "
            f"{plural(machine, 'core')} (each thread gets {machine / (processes * threads):.2g} of a core)")


def differences(profiled: Mapping[str, Any], training: Mapping[str, Any]) -> list[str]:
    """Sentences naming each condition that differs between a profile's and a training run's, with
    how far it may move the predictions; [] when they match (or the profile recorded none)."""
    found = []
    was, now = profiled.get("threads"), training.get("threads")
    if was is not None and now is not None and was != now:
        found.append(f"the profile was measured with {plural(was, 'thread')} per process, training runs {now}: "
                     f"compute may take up to {max(was, now) / min(was, now):.2g}x "
                     f"{'longer' if now < was else 'less'} than predicted (profile with --threads {now}, or give "
                     f"each process {was})")
    was, now = profiled.get("processes"), training.get("processes")
    if was is not None and now is not None and was != now:
        found.append(f"the profile was measured with {was} process{'es' if was != 1 else ''} computing on this "
                     f"machine, training runs {now}: processes on one CPU share its caches and memory bandwidth "
                     f"(5-8% longer steps with a second one on the 2-core test machine), so compute may take "
                     f"{'longer' if now > was else 'less'} than predicted (profile with --processes {now})")
    loaded = profile_load_warning(profiled)
    if loaded:
        found.append(loaded)
    crowded = oversubscribed(training)
    if profiled and crowded:
        slower = training["processes"] * training["threads"] / training["cores"]
        found.append(f"{crowded}, so CPU work (all of it on a CPU machine) may take up to {slower:.2g}x longer than "
                     "predicted (train on fewer processes, or on a machine with a core per thread)")
    if "malloc" in profiled and "malloc" in training and dict(profiled["malloc"]) != dict(training["malloc"]):
        found.append(f"the profile was measured with malloc settings {dict(profiled['malloc'])}, training runs "
                     f"{dict(training['malloc'])}: CPU steps may differ by 5-10%")
    return found


def steady_malloc(argv: Sequence[str]) -> None:
    """Re-exec `sys.executable argv` with STEADY_MALLOC in the environment, unless it is already set.

    The process keeps its pid (exec), so it stays torchrun's worker; child processes inherit the
    setting. A no-op where a variable is already set (the user's choice wins)."""
    if all(name in os.environ for name in STEADY_MALLOC):
        return
    os.execve(sys.executable, [sys.executable, *argv], {**STEADY_MALLOC, **os.environ})


def keep_freed_memory() -> bool:
    """Make this process keep freed memory as STEADY_MALLOC makes a process started with it (glibc's
    `mallopt`, each value capped at a C int), and put STEADY_MALLOC in `os.environ` (for
    `current_conditions` and child processes). For the Python API (`profile_model`, `Engine`) in a
    process not started by the commands. A no-op returning False where a variable is already set
    (the user's choice wins) or the C library is not glibc; True where it changed the settings."""
    if any(name in os.environ for name in STEADY_MALLOC):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = [mallopt(_MALLOPT[name], min(int(value), _INT_MAX)) == 1 for name, value in STEADY_MALLOC.items()]
    if not all(applied):  # (each tried: an older glibc refuses a mapping threshold above 32 MiB, not the trim one)
        return False
    os.environ.update(STEADY_MALLOC)
    return True
