"""The scheduler process: the engine and its scheduler behind a ZeroMQ inbox.

Loop: take every message waiting (without blocking while requests run; blocking up to a second
when idle, to notice a dead parent) -> one scheduler step -> send its tokens to the detokenizer.
Requests join and leave between steps, so an abort frees its KV before the next forward pass.
Everything this process sends goes to the detokenizer worker (ipc/messages.py), which forwards
what is not token output to the api server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import zmq

from minfer.config import EngineConfig
from minfer.core import InvalidRequestError
from minfer.ipc import messages as m
from minfer.ipc.process import exit_without_teardown, parent_alive, setup_worker_process
from minfer.ipc.sockets import Endpoints, fail_start, inbox, outbox, recv_ready, send
from minfer.observability.metrics import RequestTimer, StatsLogger, scheduler_stats

if TYPE_CHECKING:  # the api server imports this module to spawn it; torch loads in the child only
    from minfer.runner.runner import Runner
    from minfer.scheduler.scheduler import StepOutput

log = logging.getLogger(__name__)


class SchedulerLoop:
    """Message handling around a Runner, separate from the sockets so tests can drive it."""

    def __init__(self, runner: Runner, send_out):
        self.runner = runner
        self.scheduler = runner.scheduler
        self.send_out = send_out
        self.timer = RequestTimer()  # queue and prefill time, sent with each first token
        self.stats_log = StatsLogger(runner.config.log_stats_interval)

    def handle(self, msg: m.Message) -> None:
        if isinstance(msg, m.TokenizedRequest):
            if msg.stream is not None:  # before any output of the request, on the same pipe
                self.send_out(msg.stream)
            self.add(msg)
            req = self.scheduler.by_uid.get(msg.uid)
            if req is not None:
                self.timer.arrived(msg.uid, req.arrival_time)
        elif isinstance(msg, m.AbortRequest):
            out = self.runner.abort(msg.uid)
            if out is not None:
                self.send_outputs([out])
        elif isinstance(msg, m.InfoQuery):
            self.send_out(m.InfoReply(call_id=msg.call_id, info=self.live_info()))
        else:
            log.warning("scheduler ignored an unexpected %s", type(msg).__name__)

    def add(self, msg: m.TokenizedRequest) -> None:
        try:
            self.runner.add(msg.token_ids, msg.params, uid=msg.uid, max_tokens_auto=msg.max_tokens_auto)
        except InvalidRequestError as e:
            self.send_out(m.RequestFailed.invalid(msg.uid, e))
        except Exception as e:  # a bug must fail this request, not every request
            log.exception("add_request failed")
            self.send_out(m.RequestFailed(uid=msg.uid, message=f"internal error: {e}", status=500))

    def step(self) -> None:
        start = time.monotonic()
        prefill_steps = self.scheduler.counters.prefill_steps
        outputs = self.runner.step()
        self.timer.after_step(self.scheduler, start, self.scheduler.counters.prefill_steps != prefill_steps)
        if outputs:
            self.send_outputs(outputs, start)
        self.stats_log.maybe_log(self.scheduler)

    def send_outputs(self, outputs: list[StepOutput], step_start: float | None = None) -> None:
        now = time.monotonic()
        timings, cached = {}, {}
        for o in outputs:
            if o.token_id is not None and (t := self.timer.first_token(o.uid, step_start or now, now)):
                timings[o.uid] = t
            if o.cached_tokens is not None:  # set with the first token only
                cached[o.uid] = o.cached_tokens
            if o.finish_reason:
                self.timer.forget(o.uid)
        self.send_out(
            m.TokenOutputs(
                uids=[o.uid for o in outputs],
                token_ids=[o.token_id for o in outputs],
                finish_reasons=[o.finish_reason for o in outputs],
                stop_reasons=[o.stop_reason for o in outputs],
                first_token_timings=timings,
                logprobs={o.uid: o.logprobs for o in outputs if o.logprobs is not None},
                prompt_logprobs={o.uid: o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None},
                cached_tokens=cached,
            )
        )

    def startup_info(self) -> dict:
        engine = self.scheduler.engine
        return {
            "model": engine.source.name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "device": str(engine.device),
            "dtype": str(engine.dtype),
            "kv_cache_dtype": str(engine.kv_pool.storage_dtype),
            "max_running_requests": engine.max_running_requests,
            "max_request_tokens": self.runner.max_request_tokens,
            "eos_token_ids": sorted(engine.eos_token_ids),
            "sampling_defaults": engine.sampling_defaults,
            "memory": engine.memory.as_dict(),
            "memory_line": engine.memory.describe(engine.max_model_len),
        }

    def live_info(self) -> dict:
        sched, kv = self.scheduler, self.scheduler.kv
        return {
            "kv_pool": {
                "page_size": kv.page_size,
                "total_pages": kv.num_pages,
                "free_pages": kv.allocator.num_free_pages,
                "cached_pages": kv.prefix_cache.cached_pages,
                "used_pages": kv.used_pages,
            },
            "requests": {
                "waiting": len(sched.waiting),
                "prefilling": len(sched.prefilling),
                "running": len(sched.running),
            },
            "counters": dataclasses.asdict(sched.counters),
            "stats": scheduler_stats(sched),  # what /metrics exports
            "host_kv_pool": self._host_kv_info(),
        }

    def _host_kv_info(self) -> dict | None:
        """The host KV tier (--host-kv-cache-gb), None when off; its size is in `memory` too."""
        kv = self.scheduler.kv
        if kv.host_tier is None:
            return None
        host = kv.host_tier.host
        return {
            "bytes": host.num_bytes,
            "tokens": host.num_slots,
            "total_pages": host.allocator.num_pages,
            "free_pages": host.allocator.num_free_pages,
            "cached_pages": kv.prefix_cache.host_pages,
            "pinned": kv.host_tier.cuda,
            "staging_bytes": kv.host_tier.staging_bytes,  # device memory of its transfer buffers
        }


@exit_without_teardown
def run_scheduler_worker(
    config: EngineConfig, endpoints: Endpoints, parent_pid: int, rendezvous: socket.socket | None = None
) -> None:
    """Entry point of the scheduler process (started by server/launch.py); `rendezvous`: with
    --tp N, the socket rank 0's store listens on (ranks.rendezvous_socket)."""
    setup_worker_process("minfer-scheduler", config.log_level)
    ctx = zmq.Context()
    sock = inbox(ctx, endpoints.scheduler)
    to_detokenizer = outbox(ctx, endpoints.detokenizer)
    try:
        from minfer.engine.engine import freeze_long_lived_objects
        from minfer.runner.runner import Runner

        # With --tp N: rank 0; launch.py started the others.
        runner = Runner(config, spawn_followers=False, rendezvous=rendezvous)
        freeze_long_lived_objects()
    except Exception as e:
        log.exception("the engine failed to start")
        fail_start(to_detokenizer, "scheduler", e)
    loop = SchedulerLoop(runner, lambda msg: send(to_detokenizer, msg))
    send(to_detokenizer, m.WorkerReady(role="scheduler", pid=os.getpid(), info=loop.startup_info()))
    try:
        while parent_alive(parent_pid):
            for msg in recv_ready(sock, "scheduler", timeout_ms=0 if runner.has_work else 1000):
                loop.handle(msg)
            if runner.has_work:
                loop.step()
    finally:
        runner.shutdown()
