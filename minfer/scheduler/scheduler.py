"""The scheduler: owns request state and runs the step loop; the policies live beside it.

One step: plan a batch (prefill.py: admit waiting requests into a prefill batch if any fit,
else decode.py: a decode batch of every running request, preempting if the pool is short)
-> allocate KV slots -> launch the engine's forward pass -> advance the request lengths ->
read the previous pass's tokens (results.py) -> finish the requests that ended. Requests join
and leave between steps. Queues: queues.py.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import dataclass, field

from minfer.config import EngineConfig
from minfer.core import Batch, FinishReason, InvalidRequestError, Phase, Req, SamplingParams
from minfer.engine.engine import Engine, ForwardResult
from minfer.kvcache.host_tier import HostTier
from minfer.kvcache.manager import KVManager
from minfer.observability.scheduler_trace import scheduler_trace
from minfer.observability.trace import NULL_TRACER, RequestTracer
from minfer.scheduler.decode import DecodePlanner
from minfer.scheduler.prefill import PrefillPlanner
from minfer.scheduler.queues import RequestQueues
from minfer.scheduler.results import StepOutput, read_results

__all__ = ["Phase", "Scheduler", "SchedulerCounters", "StepOutput"]


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_batch_total: int = 0  # sum of decode batch sizes (mean = this / decode_steps)
    prefill_seconds: float = 0.0  # wall time of steps, from scheduling to tokens on the CPU
    decode_seconds: float = 0.0
    # decode steps and their seconds by batch size, in power-of-two bands keyed by the band's
    # lowest size (1, 2, 4, ...): where a run's decode time goes as its batch drains
    decode_by_batch: dict[int, list] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self, engine: Engine, config: EngineConfig | None = None, tracer: RequestTracer | None = None
    ):
        self.engine = engine
        self.config = config or engine.config
        if tracer is None:
            tracer = RequestTracer(self.config.trace_requests) if self.config.trace_requests else NULL_TRACER
        self.tracer = tracer
        self.trace = scheduler_trace(tracer)
        # Free KV a running request may need before the next admission: one page each, so an
        # admitted batch does not preempt itself on its first decode step.
        self.decode_reserve_pages = 1
        host_pool = getattr(engine, "host_kv_pool", None)
        self.kv = KVManager(
            engine.kv_pool.num_slots,
            self.config.page_size,
            engine.page_table,
            self.config.cache,
            HostTier(engine.kv_pool, host_pool) if host_pool is not None else None,
            self.config.host_kv_write_policy,
        )
        if self.trace.enabled and hasattr(self.kv.prefix_cache, "trace"):
            self.kv.prefix_cache.trace = self.trace  # kv_offloaded / kv_loaded events
        self.queues = RequestQueues()
        self.counters = SchedulerCounters()
        self.prefill = PrefillPlanner(
            self.queues,
            self.kv,
            self.config,
            engine.max_running_requests,
            self.decode_reserve_pages,
            self.trace,
        )
        self.decode = DecodePlanner(self.queues, self.kv, self.trace, self.counters)
        self.in_flight: tuple[Batch, ForwardResult] | None = None  # launched, tokens not read yet
        self.check_kv = self.config.check_kv_invariants or os.environ.get(
            "MINFER_CHECK_KV_INVARIANTS", ""
        ) not in ("", "0")
        self._seed_source = random.Random(self.config.seed)
        self._uids = itertools.count()
        self.trace.pool(self.kv.num_pages * self.kv.page_size, self.kv.page_size)

    # The queues, by name (queues.py says what each holds).
    @property
    def waiting(self):
        return self.queues.waiting

    @property
    def prefilling(self) -> list[Req]:
        return self.queues.prefilling

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def by_uid(self) -> dict[int, Req]:
        return self.queues.by_uid

    # -- intake --------------------------------------------------------------------------------
    def new_uid(self) -> int:
        return next(self._uids)

    def add_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        uid: int | None = None,
        arrival_time: float | None = None,
    ) -> Req:
        """Validate and queue a request; raises InvalidRequestError naming the limit it breaks."""
        self.validate(token_ids, params)
        grammar = None
        if params.structured_output is not None:
            if self.engine.tp.size > 1 or self.engine.tokenizer is None:
                raise InvalidRequestError("structured output needs a tokenizer and tp=1", "response_format")
            grammar = self.engine.grammar_backend().matcher(params.structured_output)
        uid = self.new_uid() if uid is None else uid
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(32)
        req = Req(
            uid=uid,
            token_ids=list(token_ids),
            prompt_len=len(token_ids),
            params=params,
            eos_token_ids=self.engine.eos_token_ids,
            seed=seed,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            grammar=grammar,
        )
        self.by_uid[uid] = req
        self.waiting.append(req)
        self.counters.prompt_tokens += len(token_ids)
        self.trace.queued(req)
        return req

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        max_len = self.engine.max_model_len
        if len(token_ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens, but the request has "
                f"{len(token_ids)} prompt tokens and max_tokens={params.max_tokens} "
                f"({len(token_ids) + params.max_tokens} in total)",
                "max_tokens",
                "context_length_exceeded",
            )
        pool_tokens = self.pool_request_tokens
        if len(token_ids) + params.max_tokens > pool_tokens:
            raise InvalidRequestError(
                f"the request needs {len(token_ids)} prompt + {params.max_tokens} max_tokens KV slots, more than "
                f"the whole KV pool holds ({pool_tokens} tokens)",
                "max_tokens",
            )
        for field_name, ids in (
            ("prompt", token_ids),
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", [t for word in params.bad_words_ids for t in word]),
        ):
            bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})", field_name
                )

    @property
    def pool_request_tokens(self) -> int:
        """Prompt + max_tokens the KV pool holds for one request alone: it must be able to finish
        alone, or preemption could not help it."""
        return (self.kv.num_pages - self.decode_reserve_pages) * self.config.page_size

    def abort(self, uid: int) -> StepOutput | None:
        """End a request wherever it is; its KV is freed now. None if it is unknown or done."""
        req = self.by_uid.get(uid)
        if req is None:
            return None
        self.finish(req, FinishReason.ABORT)
        return StepOutput(uid, None, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.in_flight)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        batch = self.prefill.plan() or self.decode.plan()
        if batch is None and self._prefill_stalled():
            # Half-prefilled requests can hold the whole pool between them: an admission counts
            # a request's next chunk only in the plan that admits it, and one whose host-tier load
            # was still in flight takes its pages in a later plan, after others took them. With
            # nothing running to preempt (decode.py) nothing would ever move: the newest one goes
            # back to the queue, its KV to the prefix cache, and the rest continue.
            self.decode.preempt(self.queues.prefilling[-1])
            batch = self.prefill.plan()
        return batch

    def _prefill_stalled(self) -> bool:
        """No pass can be planned, none is in flight to end, no host-tier load is still to land,
        and more than one request is half-prefilled: they are waiting for each other's pages."""
        q = self.queues
        return (
            len(q.prefilling) > 1
            and not self.in_flight
            and not q.running
            and all(self.kv.load_allows_run(r) for r in q.prefilling)
        )

    @property
    def overlap(self) -> bool:
        # Also on by default on CPU, where nothing runs concurrently but the same code path is tested.
        return not self.config.disable_overlap_schedule

    def step(self) -> list[StepOutput]:
        """One turn of the loop: schedule and launch a batch, then read the previous batch's tokens.

        Request lengths advance when a batch is launched, so the next batch can be scheduled
        before this one's tokens reach the CPU (overlap mode: the CPU work of step N+1 runs
        while the device computes step N). Without overlap, a batch is read right after launch.
        """
        start = time.perf_counter()
        batch = self.schedule()
        launched = None
        if batch is not None:
            # A decode step writes its slots into the device page table itself.
            batch.out_loc = self.kv.allocate(
                batch.reqs, batch.extend_lens, write_device=batch.phase != Phase.DECODE
            )
            self.trace.scheduled(batch)
            launched = (batch, self.engine.forward_batch(batch))
            self.advance(batch)
        outputs = []
        if self.in_flight is not None:
            outputs = self.process(*self.in_flight)
            self.in_flight = None
        if launched is not None:
            if self.overlap:
                self.in_flight = launched
            else:
                outputs += self.process(*launched)
            self._count_step(batch, time.perf_counter() - start)
        if self.check_kv:
            self.check_invariants()
        return outputs

    def check_invariants(self) -> None:
        """Queue membership and page ownership (KVManager.check); raises KVInvariantError."""
        self.queues.check()
        self.kv.check(self.queues.holders)

    def advance(self, batch: Batch) -> None:
        """The launched pass computes each request's K/V for its chunk and (where it samples) one
        more token, now known on the device. A prompt that is complete goes to the prefix cache
        now, so later requests with the same prefix hit it while this one still runs."""
        moved = {}
        for req, n, sampled in zip(batch.reqs, batch.extend_lens, batch.sample_mask):
            req.cached_len += n
            if batch.phase == Phase.PREFILL:
                self.counters.prefill_tokens_computed += n
            if sampled:
                req.device_len += 1
                if batch.phase == Phase.PREFILL:
                    self.prefilling.remove(req)
                    self.running.append(req)
                    moved[req.uid] = self.kv.cache_prompt(req)
        self.trace.advanced(batch, moved)

    def process(self, batch: Batch, result: ForwardResult) -> list[StepOutput]:
        """Tokens of a finished pass reach the CPU: append them, finish the requests that end."""
        outputs, ending = read_results(batch, result, self.engine.max_model_len, self.trace)
        self.counters.generation_tokens += len(outputs)
        for req, reason in ending:
            self.finish(req, reason)
        return outputs

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request wherever it is (a queue, or a pass in flight) and hand back its KV."""
        req.finish_reason = reason
        self.queues.remove(req)  # a preempted one may sit in waiting while its last pass flies
        if req.table_idx >= 0:
            self.trace.released(req, self.kv.release(req), self.kv.page_size)
        req.device_len = len(req.token_ids)  # forget a pass launched after the end (overlap)
        del self.by_uid[req.uid]
        self.trace.ended(req)

    def _count_step(self, batch: Batch, seconds: float) -> None:
        c = self.counters
        if batch.phase == Phase.PREFILL:
            c.prefill_steps += 1
            c.prefill_seconds += seconds
        else:
            c.decode_steps += 1
            c.decode_batch_total += batch.size
            c.decode_seconds += seconds
            band = c.decode_by_batch.setdefault(1 << (batch.size.bit_length() - 1), [0, 0.0])
            band[0] += 1
            band[1] += seconds
