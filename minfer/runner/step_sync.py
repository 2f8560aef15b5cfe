"""Identical scheduling on every TP rank: rank 0 broadcasts, once per step, what changed.

Every rank runs its own Scheduler over its own Engine. The scheduler is deterministic given
the sequence of add_request / abort calls and the sampled tokens, so rank 0 (the only one that
hears from users) broadcasts, before each step, the requests it added (uid, prompt, sampling
params, seed) and the requests it aborted since the last step, and nothing else.

Sampled tokens need no broadcast: the LM head all-gathers the logits, so every rank holds the
very same logits bytes (rank r's vocabulary slice comes from rank r on every rank), and the
sampler is a deterministic function of (logits, seed, position). To catch a divergence anyway
(a nondeterministic kernel, a bug), each step order carries a CRC of the tokens rank 0's
previous step produced; a follower whose own tokens differ stops with an error naming the step,
instead of silently computing on other tokens.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from array import array
from typing import TYPE_CHECKING

import msgspec

from minfer.core import Req, SamplingParams
from minfer.distributed.faults import fault_point
from minfer.distributed.parallel import TensorParallelError, TPGroup, leave_tp_group

if TYPE_CHECKING:
    from minfer.engine.engine import Engine
    from minfer.runner.ranks import LocalRanks
    from minfer.scheduler.scheduler import Scheduler, StepOutput

log = logging.getLogger(__name__)

# After a rank it started dies, how long rank 0 waits for its blocked collective to fail by
# itself (gloo notices at once) before exiting the process (an NCCL wait never returns).
STUCK_COLLECTIVE_GRACE_S = 10.0


class RequestAdded(msgspec.Struct, tag=True, array_like=True):
    uid: int
    token_ids: list[int]
    params: SamplingParams
    seed: int


class RequestAborted(msgspec.Struct, tag=True, array_like=True):
    uid: int


class StepOrder(msgspec.Struct, array_like=True):
    """What followers do before rank 0's step number `step`."""

    step: int
    events: list[RequestAdded | RequestAborted]
    previous_tokens_crc: int  # of rank 0's outputs of step `step - 1`
    stop: bool = False  # leave the loop instead of stepping


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepOrder)


def tokens_crc(outputs: list[StepOutput]) -> int:
    flat = array("q")
    for o in outputs:
        flat.extend((o.uid, -1 if o.token_id is None else o.token_id))
    return zlib.crc32(flat.tobytes())


def engine_facts(engine: Engine) -> dict:
    """What must be equal on every rank for their schedulers to decide alike."""
    return {
        "vocab_size": engine.vocab_size,
        "max_model_len": engine.max_model_len,
        "kv_pool_slots": engine.kv_pool.num_slots,
        "max_running_requests": engine.max_running_requests,
        "page_size": engine.config.page_size,
        "seed": engine.config.seed,
        "chunked_prefill_size": engine.config.chunked_prefill_size,
        "cache": engine.config.cache,
        "schedule_policy": engine.config.schedule_policy,
        "disable_overlap_schedule": engine.config.disable_overlap_schedule,
    }


class StepLeader:
    """Rank 0's side: records request changes and publishes them before each step.

    With TP=1 every method is a plain pass-through, so callers need no branch.
    """

    def __init__(self, tp: TPGroup, ranks: LocalRanks | None = None):
        self.tp = tp
        self.ranks = ranks  # the follower processes this process started (offline API), if any
        self.added: list[Req | RequestAborted] = []
        self.steps = 0
        self.previous_crc = tokens_crc([])
        self.failure: str | None = None
        self.in_step = False
        self.stopped = False
        self.engine: Engine | None = None  # rank 0's engine, whose CUDA graphs go before the group
        self._stopping = threading.Event()  # wakes the watchdog at shutdown
        self._watchdog: threading.Thread | None = None
        if tp.size > 1 and ranks is not None:
            self._watchdog = threading.Thread(
                target=self._watch_ranks, name="minfer-tp-watchdog", daemon=True
            )
            self._watchdog.start()

    # -- start-up ------------------------------------------------------------------------------
    def agree(self, engine: Engine) -> None:
        """Send rank 0's engine facts (and its EOS ids: only rank 0 loads the tokenizer)."""
        self.engine = engine
        if self.tp.size > 1:
            facts = dict(engine_facts(engine), eos_token_ids=sorted(engine.eos_token_ids))
            self._guard(lambda: self.tp.broadcast_bytes(_encoder.encode(facts)))

    # -- request changes -----------------------------------------------------------------------
    def requests_added(self, reqs: list[Req]) -> None:
        if self.tp.size > 1:
            self.added.extend(reqs)

    def request_aborted(self, uid: int) -> None:
        if self.tp.size > 1:
            self.added.append(RequestAborted(uid))

    # -- the step --------------------------------------------------------------------------------
    def step(self, scheduler: Scheduler) -> list[StepOutput]:
        """Publish the changes since the last step, then step this rank's scheduler."""
        if self.tp.size == 1:
            return scheduler.step()
        outputs = self._guard(lambda: self._publish_and_step(scheduler))
        self.previous_crc = tokens_crc(outputs)
        return outputs

    def _publish_and_step(self, scheduler: Scheduler) -> list[StepOutput]:
        self._publish(stop=False)
        fault_point(0, f"step{self.steps}")
        self.steps += 1
        return scheduler.step()

    def _publish(self, stop: bool) -> None:
        events = [
            e
            if isinstance(e, RequestAborted)
            else RequestAdded(e.uid, e.token_ids[: e.prompt_len], e.params, e.seed)
            for e in self.added
        ]
        self.added = []
        order = StepOrder(self.steps, events, self.previous_crc, stop)
        self.tp.broadcast_bytes(_encoder.encode(order))

    def _guard(self, work):
        """Run a collective-bearing piece of work; any failure stops every rank and raises one
        TensorParallelError that names the rank that died, when one did."""
        if self.failure:
            raise TensorParallelError(self.failure)
        if self.stopped:
            raise TensorParallelError("the tensor-parallel group was shut down")
        self.in_step = True
        try:
            return work()
        except BaseException as e:
            self.failure = self._failure_reason(e)
            log.error("%s: stopping every rank", self.failure)
            self.shutdown(graceful=False)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise TensorParallelError(self.failure) from e
        finally:
            self.in_step = False

    def _failure_reason(self, error: BaseException) -> str:
        if self.ranks is not None:
            deadline = time.monotonic() + 1.0  # a peer's socket closes just before its exit code shows
            while time.monotonic() < deadline:
                dead = self.ranks.dead()
                if dead:
                    return "; ".join(dead)
                time.sleep(0.05)
        return f"a tensor-parallel step failed on rank 0: {type(error).__name__}: {error}"

    def _watch_ranks(self) -> None:
        """A rank's death fails rank 0's next collective at once on gloo, but an NCCL collective
        would wait for its timeout (minutes): exit the process if rank 0 stays stuck in a step."""
        while not self.stopped:
            dead = self.ranks.dead()
            if dead and not self.stopped:
                log.error("%s", "; ".join(dead))
                deadline = time.monotonic() + STUCK_COLLECTIVE_GRACE_S
                while self.in_step and not self.failure and time.monotonic() < deadline:
                    time.sleep(0.1)
                if self.in_step and not self.failure:
                    log.critical("%s; rank 0 is stuck in a collective: exiting", "; ".join(dead))
                    os._exit(1)
                return
            self._stopping.wait(0.2)

    def shutdown(self, graceful: bool = True) -> None:
        """Tell the followers to leave (graceful) or stop them, then leave the groups."""
        if self.tp.size == 1 or self.stopped:
            return
        self.stopped = True
        self._stopping.set()
        if graceful and not self.failure:
            try:
                self._publish(stop=True)
            except Exception:  # noqa: BLE001 - a follower already gone: stop() below handles it
                graceful = False
        if self.ranks is not None:
            self.ranks.stop(wait_s=10.0 if graceful else 0.0)
        if self.engine is not None:
            # NCCL's communicator teardown waits for the graphs that captured its collectives
            # to be destroyed: with them alive, leave_tp_group never returned (2 x H200).
            self.engine.release_cuda_graphs()
        leave_tp_group(self.tp)
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            # Its frame holds this leader, and so the groups, until it returns: joined, the job's
            # groups and store are freed with the job rather than whenever the thread wakes.
            self._watchdog.join(timeout=1.0)


def follow(tp: TPGroup, engine: Engine, scheduler: Scheduler) -> None:
    """A follower rank's loop: receive rank 0's order, apply it, step; until told to stop."""
    facts = msgspec.msgpack.decode(tp.broadcast_bytes(None))
    mine = engine_facts(engine)
    for key, value in mine.items():
        if facts[key] != value:
            raise TensorParallelError(f"rank {tp.rank} has {key}={value!r} but rank 0 has {facts[key]!r}")
    engine.eos_token_ids = frozenset(facts["eos_token_ids"])  # rank 0 also read the tokenizer's
    crc = tokens_crc([])
    steps = 0
    while True:
        order = _decoder.decode(tp.broadcast_bytes(None))
        if order.step != steps or order.previous_tokens_crc != crc:
            raise TensorParallelError(
                f"rank {tp.rank} diverged from rank 0 before step {order.step} (its step {steps}): the "
                f"sampled tokens differ (CRC {crc:#x} here, {order.previous_tokens_crc:#x} on rank 0)"
            )
        if order.stop:
            return
        for event in order.events:
            if isinstance(event, RequestAborted):
                scheduler.abort(event.uid)
            else:
                req = scheduler.add_request(event.token_ids, event.params, uid=event.uid)
                req.seed = event.seed
        fault_point(tp.rank, f"step{steps}")
        steps += 1
        crc = tokens_crc(scheduler.step())
