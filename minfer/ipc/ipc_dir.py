"""The private directory the ZeroMQ sockets live in, removed on every way this process ends.

A normal exit (return, exception, SIGTERM, Ctrl-C) removes it in `close`. For a kill -9 nothing
in this process runs, so a small shell started with it waits on a pipe only this process holds
open: the kernel closes the pipe when the process dies, however it dies, and the shell then
removes the directory. The worker processes never hold the pipe (spawned children inherit no
file descriptors but the ones they are given), so it closes when this process does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from minfer.ipc.sockets import INBOX_NAMES

# A unix socket's path must fit sockaddr_un's sun_path with its terminating NUL: 108 bytes on
# Linux, 104 on macOS. A long TMPDIR (a batch system's per-job directory, pytest's) passes it.
MAX_SOCKET_PATH_BYTES = 103

# `read` returns at end of file; signals to the process group (Ctrl-C) are ignored so the shell
# outlives the server it cleans up after.
_JANITOR = 'trap "" INT TERM HUP; read -r _; rm -rf -- "$1"'


class IpcDir:
    """A fresh `minfer-ipc-*` directory (mode 0700, so other users cannot reach the sockets)."""

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="minfer-ipc-")
        if not sockets_fit(self.path):  # in /tmp instead, where they do
            os.rmdir(self.path)
            self.path = tempfile.mkdtemp(prefix="minfer-ipc-", dir="/tmp")
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


def sockets_fit(directory: str) -> bool:
    """Whether every inbox's socket path in `directory` fits a unix socket address."""
    longest = max(INBOX_NAMES, key=len)
    return len(os.fsencode(os.path.join(directory, longest))) <= MAX_SOCKET_PATH_BYTES
