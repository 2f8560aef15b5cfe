"""What the server's processes carry and how they leave: the api process never imports torch,
and a worker leaves through os._exit with multiprocessing's exit codes (minfer.ipc.process)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys

import pytest

from minfer.ipc.process import exit_without_teardown


def test_the_api_process_checks_the_model_without_torch():
    """`minfer serve`'s checks before it starts the workers (cli._preflight) and the api server's
    modules load no torch: it would add ~2 s to every start and 300 MB to the process."""
    code = (
        "import sys\n"
        "from minfer.cli import _preflight\n"
        "from minfer.config import EngineConfig\n"
        "import minfer.server.launch, minfer.server.api\n"
        "_preflight(EngineConfig())\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@exit_without_teardown
def _worker(how: str, marker: str) -> None:
    import atexit
    import pathlib

    atexit.register(pathlib.Path(marker).write_text, how)  # exit handlers still run
    if how == "exit3":
        raise SystemExit(3)
    if how == "fails":
        raise RuntimeError("the worker failed")
    if how == "message":
        raise SystemExit("a message")


@pytest.mark.parametrize("how,code", [("returns", 0), ("exit3", 3), ("fails", 1), ("message", 1)])
def test_a_worker_leaves_with_multiprocessings_exit_codes_after_its_exit_handlers(how, code, tmp_path):
    marker = tmp_path / "atexit"
    proc = mp.get_context("spawn").Process(target=_worker, args=(how, str(marker)))
    proc.start()
    proc.join(60)
    assert proc.exitcode == code
    assert marker.read_text() == how
