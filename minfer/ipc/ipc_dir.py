"""The private directory the ZeroMQ sockets live in, removed on every way this process ends.

A normal exit (return, exception, SIGTERM, Ctrl-C) removes it in `close`. For a kill -9 nothing
in this process runs, so a small shell started with it waits on a pipe only this process holds
open: the kernel closes the pipe when the process dies, however it dies, and the shell then
removes the directory. The worker processes never hold the pipe (spawned children inherit no
file descriptors but the ones they are given), so it closes when this process does.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile

# `read` returns at end of file; signals to the process group (Ctrl-C) are ignored so the shell
# outlives the server it cleans up after.
_JANITOR = 'trap "" INT TERM HUP; read -r _; rm -rf -- "$1"'


class IpcDir:
    """A fresh `minfer-ipc-*` directory (mode 0700, so other users cannot reach the sockets)."""

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="minfer-ipc-")
        self._janitor = subprocess.Popen(
            ["sh", "-c", _JANITOR, "minfer-ipc-janitor", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            close_fds=True,
        )

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._janitor.stdin.close()  # the janitor finds nothing left to remove and exits
        self._janitor.wait()
