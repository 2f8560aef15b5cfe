"""The processes of a tensor-parallel job: one per rank.

Rank 0 is the process that hears from users: the `LLM(...)` caller (offline API) or the
scheduler worker (`minfer serve`). Ranks 1..N-1 are followers (`follower_main`): each loads its
shard of the model and replays rank 0's scheduling decisions (runner/step_sync.py).

Who starts the followers of a node:
  - offline API on node 0: `start_rank_zero` runs them as `python -m minfer.runner.ranks`
    subprocesses (no re-import of the user's script, unlike multiprocessing's spawn);
  - `minfer serve` on node 0: server/launch.py spawns them next to the other workers;
  - any command on node k > 0: `run_worker_node` runs the node's ranks until rank 0 stops them.
Followers die with the process that started them (PR_SET_PDEATHSIG) and leave their loop when a
peer's socket closes, so a dead rank 0 never leaves followers behind.

This module imports torch lazily: the api server imports it to spawn followers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from minfer.config import EngineConfig

if TYPE_CHECKING:
    from minfer.runner.step_sync import StepLeader

log = logging.getLogger(__name__)

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def free_local_addr() -> str:
    """An address on this host that was free a moment ago (tests that start two nodes by hand)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def rendezvous_socket() -> socket.socket:
    """A listening socket on a free local port for rank 0's rendezvous store, made by a launcher
    that must tell the other ranks the address before rank 0 exists (`minfer serve`). Rank 0 serves
    the store on this very socket (create_store's `listener`): an address only found free here and
    bound seconds later by rank 0 could be taken in between."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def device_type_of(config: EngineConfig) -> str:
    from minfer.engine.engine import resolve_device

    return resolve_device(config.device).type


def follower_main(config: EngineConfig, rank: int) -> None:
    """Join the TP group as `rank`, load this rank's shard, follow rank 0 until it stops."""
    from minfer.distributed.faults import fault_point
    from minfer.distributed.parallel import create_store, join_tp_group
    from minfer.engine.engine import Engine, freeze_long_lived_objects
    from minfer.observability.trace import NULL_TRACER
    from minfer.runner.step_sync import follow
    from minfer.scheduler.scheduler import Scheduler

    tp = join_tp_group(config, rank, create_store(config, rank), device_type_of(config))
    fault_point(rank, "init")
    engine = Engine(config, tp)
    scheduler = Scheduler(engine, tracer=NULL_TRACER)  # rank 0 writes the request trace
    freeze_long_lived_objects()  # a follower keeps its engine for life, as the scheduler process does
    follow(tp, engine, scheduler)


def run_follower_rank(config: EngineConfig, rank: int) -> None:
    """Entry point of a follower process (spawned by server/launch.py, or by `main` below).

    However it ends, the process leaves through os._exit: tearing down an NCCL communicator
    (explicitly or in its destructor at interpreter exit) can wait for peers that are gone,
    and a follower has nothing else to clean up."""
    from minfer.ipc.process import setup_worker_process

    setup_worker_process(f"minfer-tp{rank}", config.log_level)
    code = 0
    try:
        follower_main(config, rank)
    except SystemExit as e:  # SIGTERM from the api server
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class LocalRanks:
    """Follower ranks run as subprocesses of this process."""

    def __init__(self, config: EngineConfig, ranks: list[int]):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        config_json = json.dumps(dataclasses.asdict(config))
        self.procs = {
            rank: subprocess.Popen(
                [sys.executable, "-m", "minfer.runner.ranks", "--rank", str(rank), "--config", config_json],
                env=env,
            )
            for rank in ranks
        }

    def dead(self) -> list[str]:
        """One line per rank process that has exited."""
        return [
            f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.returncode}"
            for rank, p in self.procs.items()
            if p.poll() is not None
        ]

    def check(self) -> None:
        from minfer.distributed.parallel import TensorParallelError

        dead = self.dead()
        if dead:
            raise TensorParallelError("; ".join(dead))

    def wait(self) -> int:
        """Wait for every rank to exit; the worst exit code."""
        return max((p.wait() for p in self.procs.values()), default=0)

    def stop(self, wait_s: float) -> None:
        """Give the ranks `wait_s` to exit on their own, then kill them: a rank blocked in a
        collective would not run a SIGTERM handler until the collective returns."""
        deadline = time.monotonic() + wait_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


def start_rank_zero(
    config: EngineConfig, spawn_followers: bool, listener: socket.socket | None = None
) -> StepLeader:
    """Make this process rank 0: listen for the other ranks (starting this node's followers
    when asked), join the group. Returns the StepLeader the scheduler loop steps through.
    `listener`: the socket from rendezvous_socket, bound to config.dist_init_addr's port."""
    from minfer.distributed.faults import fault_point
    from minfer.distributed.parallel import SINGLE, RankLayout, create_store, join_tp_group, leave_tp_group
    from minfer.runner.step_sync import StepLeader

    layout = RankLayout.of(config)
    if config.tp == 1:
        return StepLeader(SINGLE)
    assert layout.node_rank == 0, "only node 0 hosts rank 0"
    store = create_store(config, 0, listener)
    host = (config.dist_init_addr or "127.0.0.1:0").rpartition(":")[0]
    follower_config = dataclasses.replace(config, dist_init_addr=f"{host}:{store.port}")
    ranks = LocalRanks(follower_config, layout.node_ranks[1:]) if spawn_followers else None
    tp = SINGLE
    try:
        tp = join_tp_group(config, 0, store, device_type_of(config), ranks.check if ranks else None)
        fault_point(0, "init")
    except BaseException:
        if ranks is not None:
            ranks.stop(wait_s=0.0)
        leave_tp_group(tp)
        raise
    return StepLeader(tp, ranks)


def run_worker_node(config: EngineConfig) -> int:
    """Node k > 0 of a multi-node job: run this node's ranks until rank 0 stops them."""
    from minfer.distributed.parallel import RankLayout

    layout = RankLayout.of(config)
    log.info(
        "node %d of %d: running tensor-parallel ranks %s, rank 0 at %s",
        layout.node_rank,
        layout.nnodes,
        layout.node_ranks,
        config.dist_init_addr,
    )
    ranks = LocalRanks(config, layout.node_ranks)
    try:
        return ranks.wait()
    finally:
        ranks.stop(wait_s=0.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one follower rank of a tensor-parallel job (internal)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    args = parser.parse_args(argv)
    run_follower_rank(EngineConfig(**json.loads(args.config)), args.rank)


if __name__ == "__main__":
    main()
