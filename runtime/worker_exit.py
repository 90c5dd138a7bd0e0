"""How a torchrun worker ends: `Stopped` (a SIGTERM), and its exit status at once, without exit-time clean-up."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["Stopped", "exit_worker"]


class Stopped(BaseException):
    """SIGTERM to a worker: torchrun's launcher stopping every rank (it does when one exits, or when the job is
    cancelled), or a signal to this process alone (`kill PID`). A BaseException, as KeyboardInterrupt is: the model
    file's code, which runs wrapped in `except Exception` (its errors become one line naming the file), must not take
    it for the model's own failure ("build_model() raised Stopped")."""


def exit_worker(code: int) -> NoReturn:
    """Flush stdout and stderr and end this process with `code` (os._exit: no atexit handlers, no finalizers).

    Why: torch's teardown of a gloo process group at interpreter exit aborts now and then on busy cores
    ("terminate called without an active exception", SIGABRT: seen in about one run in five of 2
    ranks on 2 cores, after destroy_process_group as well as without it), and after a lost peer a
    thread may still be blocked in a receive that the clean-up would wait for. The caller has
    written and closed every file it means to leave.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
