"""What every worker process does first, so that none outlives the server."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def setup_worker_process(name: str, log_level: str = "info") -> None:
    """Name the process (`ps`/`pgrep` show it), die with the parent, and leave Ctrl-C to it.

    The terminal sends SIGINT to the whole process group; the api server then stops the workers
    itself, in order, so workers ignore SIGINT. If the api server is killed outright (SIGKILL),
    the kernel kills the workers too (PR_SET_PDEATHSIG), so no orphan keeps the accelerator.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the api server stopping us) unwinds normally, so exit handlers run (a killed
    # process leaves multiprocessing locks that tqdm or torch created to the resource tracker).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    if os.getppid() == 1:  # the parent died before PDEATHSIG was armed
        os._exit(1)
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s {name} %(name)s: %(message)s")


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def dead_workers(procs: dict) -> list[str]:
    """One line per started worker process that is no longer running."""
    return [
        f"the {role} worker (pid {p.pid}) exited with code {p.exitcode}"
        for role, p in procs.items()
        if p.pid is not None and not p.is_alive()
    ]
