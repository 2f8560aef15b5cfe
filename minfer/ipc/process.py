"""What every worker process does first, so that none outlives the server."""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import signal
import sys
import traceback

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


def exit_without_teardown(entry):
    """Wrap a worker's entry point so that its process leaves through os._exit once `entry`
    has returned or raised (its `finally` blocks have closed its sockets by then). Exit
    handlers still run (atexit: logging's flush, multiprocessing's finalizers) and stdio is
    flushed; what is skipped is Python's teardown of every loaded module, which with torch and
    transformers loaded takes ~0.7 s per process: a server's shutdown waited for three of them
    on two cores. Exit codes are multiprocessing's: 0, SystemExit's code, 1 after a traceback."""

    @functools.wraps(entry)
    def run(*args, **kwargs):
        code = 1
        try:
            entry(*args, **kwargs)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    return run


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def dead_workers(procs: dict) -> list[str]:
    """One line per started worker process that is no longer running."""
    return [
        f"the {role} worker (pid {p.pid}) exited with code {p.exitcode}"
        for role, p in procs.items()
        if p.pid is not None and not p.is_alive()
    ]
