"""`minfer serve`: start the workers, wait until they are ready, run the HTTP server, stop all.

Processes (docs/ARCHITECTURE.md): this one runs the api server; the tokenizer, scheduler (which owns the
engine) and detokenizer workers are spawned children. Shutdown paths, all ending with the
children stopped and the socket directory removed:
  - SIGINT / SIGTERM: uvicorn stops accepting, open requests get --shutdown-timeout seconds to
    finish, then the rest end with an error event; exit code 0;
  - a worker dies: /health answers 503, open requests fail with 503, then exit code 1;
  - a worker fails to start: its error is printed, exit code 1.
If this process is killed outright, the kernel kills the workers (ipc/process.py) and a janitor
removes the socket directory (ipc/ipc_dir.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time

import zmq

from minfer.config import ConfigError, EngineConfig, ServerConfig
from minfer.ipc import messages as m
from minfer.ipc.ipc_dir import IpcDir
from minfer.ipc.process import dead_workers
from minfer.ipc.sockets import Endpoints, inbox, outbox, recv_ready, send
from minfer.models.generation_config import describe_defaults
from minfer.observability.metrics import ServerMetrics
from minfer.observability.trace import NULL_TRACER, RequestTracer
from minfer.runner.ranks import rendezvous_socket, run_follower_rank, run_worker_node
from minfer.runner.worker import run_scheduler_worker
from minfer.server.client import EngineClient
from minfer.tokenizer.detokenizer_worker import run_detokenizer_worker
from minfer.tokenizer.worker import run_tokenizer_worker

log = logging.getLogger("minfer.server")

# How long /health answers 503 after a worker died before the server exits, so that whoever
# watches the server (a load balancer, a test) can see why.
UNHEALTHY_GRACE_S = 2.0
HTTP_BACKLOG = 2048  # uvicorn's default, which it passes to listen() again when it starts

# Open requests are ended with an error this long before uvicorn's graceful period is over, so
# that none is cancelled into a bare connection reset.
FAIL_BEFORE_SHUTDOWN_S = 0.5
WORKER_STOP_TIMEOUT_S = 5.0


class StartupError(Exception):
    pass


class Workers:
    """The child processes, started with `spawn` (CUDA cannot be forked)."""

    def __init__(self, config: EngineConfig, endpoints: Endpoints):
        ctx = mp.get_context("spawn")
        me = os.getpid()
        # Where the scheduler (rank 0) meets the other ranks: a socket made here, listening from
        # now on, so the followers started beside it know the address before rank 0 exists.
        self.rendezvous = None
        if config.tp > 1 and not config.dist_init_addr:
            self.rendezvous = rendezvous_socket()
            config = dataclasses.replace(
                config, dist_init_addr=f"127.0.0.1:{self.rendezvous.getsockname()[1]}"
            )
        self.procs = {
            "scheduler": ctx.Process(
                target=run_scheduler_worker,
                args=(config, endpoints, me, self.rendezvous),
                name="minfer-scheduler",
                daemon=True,
            ),
            "tokenizer": ctx.Process(
                target=run_tokenizer_worker,
                args=(config, endpoints, me),
                name="minfer-tokenizer",
                daemon=True,
            ),
            "detokenizer": ctx.Process(
                target=run_detokenizer_worker,
                args=(config, endpoints, me),
                name="minfer-detokenizer",
                daemon=True,
            ),
        }
        # Tensor-parallel ranks 1..N-1 of this node: they talk only to the scheduler (rank 0).
        self.tp_ranks = {
            f"tp-rank-{rank}": ctx.Process(
                target=run_follower_rank, args=(config, rank), name=f"minfer-tp{rank}", daemon=True
            )
            for rank in range(1, config.tp // config.nnodes)
        }

    def start(self) -> None:
        for proc in [*self.procs.values(), *self.tp_ranks.values()]:
            proc.start()
        if self.rendezvous is not None:  # the scheduler has its own copy now
            self.rendezvous.close()

    def dead(self) -> list[str]:
        return dead_workers({**self.procs, **self.tp_ranks})

    def stop(self) -> None:
        """SIGTERM each child, then SIGKILL whatever is still there after a timeout."""
        live = [
            p for p in [*self.procs.values(), *self.tp_ranks.values()] if p.pid is not None and p.is_alive()
        ]
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
        for proc in live:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)


def wait_until_ready(sock: zmq.Socket, workers: Workers) -> dict[str, dict]:
    """Wait for every worker's WorkerReady; fail fast when one fails or dies."""
    ready: dict[str, dict] = {}
    while len(ready) < len(workers.procs):
        for msg in recv_ready(sock, "api", timeout_ms=200):
            if isinstance(msg, m.WorkerReady):
                ready[msg.role] = msg.info
            elif isinstance(msg, m.WorkerFailed):
                raise StartupError(f"the {msg.role} worker failed to start: {msg.message}")
        dead = workers.dead()
        if dead and len(ready) < len(workers.procs):
            raise StartupError("; ".join(dead))
    return ready


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The server's TCP socket, listening from now on; uvicorn serves it once the model is loaded.
    Taking the port before the load refuses a taken port at once instead of after minutes, and
    holds it through the load: no other server, and no outgoing connection given it as its
    ephemeral port, can take it meanwhile. A client that connects during the load waits in the
    kernel's backlog until the server answers."""
    # As uvicorn binds its own: IPv6 for an address with a colon (so "localhost" is 127.0.0.1
    # wherever the resolver lists ::1 first), and a port whose old connections linger in
    # TIME_WAIT counts as free.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Bound but not listening, the port could still be bound by another SO_REUSEADDR socket.
        sock.listen(HTTP_BACKLOG)
    except OSError as e:
        sock.close()
        hint = " (--port picks another)" if e.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from e
    return sock


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig, listener: socket.socket | None = None) -> int:
    """Run the server until a signal or a dead worker; returns the exit code. `listener` is the
    socket from bind_http_socket (bound here when not given)."""
    logging.basicConfig(level=engine_cfg.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    if engine_cfg.node_rank > 0:  # a worker node of a multi-node job: its ranks only, no HTTP
        return run_worker_node(engine_cfg)
    listener = listener or bind_http_socket(server_cfg.host, server_cfg.port)
    server_cfg.port = listener.getsockname()[1]  # the port given, or the one --port 0 was given
    ipc_dir = IpcDir()
    endpoints = Endpoints.in_dir(ipc_dir.path)
    zctx = zmq.Context()
    api_inbox = inbox(zctx, endpoints.api)
    to_tokenizer = outbox(zctx, endpoints.tokenizer)
    workers = Workers(engine_cfg, endpoints)
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        workers.start()
        print(
            f"minfer: loading {engine_cfg.model or 'the default model'} "
            f"(to serve on port {server_cfg.port}) ...",
            flush=True,
        )
        ready = wait_until_ready(api_inbox, workers)
        # The tokenizer refuses prompts the scheduler could not take before tokenizing them all.
        send(to_tokenizer, m.PromptLimits(max_prompt_tokens=ready["scheduler"]["max_request_tokens"] - 1))
        # From here uvicorn owns SIGINT/SIGTERM (it stops serving, then re-raises the signal
        # to the handler it found, which must then do nothing).
        for sig in previous:
            signal.signal(sig, lambda signum, frame: None)
        return asyncio.run(
            _serve_http(engine_cfg, server_cfg, listener, ready, workers, api_inbox, to_tokenizer)
        )
    except KeyboardInterrupt:
        return 0
    except StartupError as e:
        print(f"minfer: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        workers.stop()
        listener.close()
        zctx.destroy(linger=0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ipc_dir.close()


async def _serve_http(
    engine_cfg: EngineConfig,
    server_cfg: ServerConfig,
    listener: socket.socket,
    ready: dict,
    workers: Workers,
    api_inbox: zmq.Socket,
    to_tokenizer: zmq.Socket,
) -> int:
    import uvicorn

    from minfer.server.api import ServerState, build_app, uvicorn_options

    # This process starts the run, so it empties the trace file the workers append to.
    tracer = (
        RequestTracer(engine_cfg.trace_requests, truncate=True) if engine_cfg.trace_requests else NULL_TRACER
    )
    info = ready["scheduler"]
    model_name = server_cfg.served_model_name or engine_cfg.model or info["model"]
    client = EngineClient(
        api_inbox,
        to_tokenizer,
        tracer,
        max_open_requests=info["max_running_requests"] + engine_cfg.max_queued_requests,
        max_unread_replies=engine_cfg.max_unread_replies,
        metrics=ServerMetrics(server_cfg.metrics_prefix, model_name, server_cfg.log_requests),
    )
    client.start()
    state = ServerState(
        client=client,
        model_name=model_name,
        engine_config=engine_cfg,
        server_config=server_cfg,
        scheduler_info=info,
        tokenizer_info=ready["tokenizer"],
        workers=workers.procs,
    )
    config = uvicorn.Config(
        build_app(state),
        host=server_cfg.host,
        port=server_cfg.port,
        log_level=engine_cfg.log_level,
        access_log=engine_cfg.log_level == "debug",
        timeout_graceful_shutdown=engine_cfg.shutdown_timeout + FAIL_BEFORE_SHUTDOWN_S,
        **uvicorn_options(server_cfg),
    )
    server = uvicorn.Server(config)
    watchdog = asyncio.create_task(_watch(server, state, workers, info["memory_line"]))
    await server.serve(sockets=[listener])
    watchdog.cancel()
    return state.exit_code


async def _watch(server, state, workers: Workers, memory_line: str) -> None:
    """Announce the address once listening; then turn a dead worker into 503s and an exit."""
    while not server.started and not server.should_exit:
        await asyncio.sleep(0.05)
    if server.started:
        cfg = state.server_config
        print(
            f"minfer: serving {state.model_name!r} on http://{cfg.host}:{cfg.port} "
            f"(OpenAI API at http://{cfg.host}:{cfg.port}/v1)",
            flush=True,
        )
        print(f"minfer: {memory_line}", flush=True)
        defaults = state.sampling_defaults
        if defaults:  # a user who expects OpenAI's temperature 1 should know why answers differ
            print(
                f"minfer: requests that leave them unset get generation_config.json's "
                f"{describe_defaults(defaults)} (--generation-config none: minfer's own)",
                flush=True,
            )
    while not server.should_exit:
        dead = workers.dead()
        if dead:
            reason = "; ".join(dead)
            log.error("%s: shutting down", reason)
            state.healthy = False
            state.exit_code = 1
            state.client.fail_all(f"the server is shutting down: {reason}")
            await asyncio.sleep(UNHEALTHY_GRACE_S)
            server.should_exit = True
            return
        await asyncio.sleep(0.25)
    # A signal is stopping the server: uvicorn accepts nothing new and waits for open requests.
    # Those still open when --shutdown-timeout is over would be cancelled into a bare 500 or a
    # cut stream; end them with a 503 error JSON (a final error event in a stream) instead.
    await asyncio.sleep(state.engine_config.shutdown_timeout)
    state.client.fail_all(
        f"the server is shutting down (open requests had {state.engine_config.shutdown_timeout:g} s "
        "to finish)"
    )
