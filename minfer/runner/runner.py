"""The Runner: rank 0's engine and scheduler, driven through the tensor-parallel step protocol.

Every driver of minfer (the offline `LLM`, the scheduler worker of `minfer serve`, `minfer
shell`) adds, aborts and steps requests through a Runner and never through the Scheduler
directly: with tp > 1 the other ranks replay exactly the changes the Runner records
(step_sync.py), so a driver that bypassed it would leave them behind. With tp = 1 the
protocol is a pass-through.
"""

from __future__ import annotations

import socket

from minfer.config import EngineConfig
from minfer.core import Req, SamplingParams
from minfer.engine.engine import Engine
from minfer.runner.ranks import start_rank_zero
from minfer.scheduler.scheduler import Scheduler, StepOutput


class Runner:
    def __init__(
        self,
        config: EngineConfig,
        spawn_followers: bool = True,
        scheduler_options: dict | None = None,
        rendezvous: socket.socket | None = None,
    ):
        """Become rank 0 (starting this node's other ranks when asked; `rendezvous`: the socket
        a launcher made for the ranks to meet at), load the engine, build the scheduler and
        agree with the other ranks on what must be equal."""
        self.config = config
        self.tp_leader = start_rank_zero(config, spawn_followers=spawn_followers, listener=rendezvous)
        try:
            self.engine = Engine(config, self.tp_leader.tp)
            self.scheduler = Scheduler(self.engine, **(scheduler_options or {}))
            self.tp_leader.agree(self.engine)
        except BaseException:
            self.tp_leader.shutdown(graceful=False)
            raise

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_request_tokens(self) -> int:
        """Prompt + max_tokens a request may have: the context, or the KV pool if smaller."""
        return min(self.engine.max_model_len, self.scheduler.pool_request_tokens)

    def add(
        self,
        token_ids: list[int],
        params: SamplingParams,
        uid: int | None = None,
        max_tokens_auto: bool = False,
        arrival_time: float | None = None,
    ) -> Req:
        """Queue a request (InvalidRequestError if it breaks a limit). `max_tokens_auto`: the
        caller gave no max_tokens, so the request may fill the rest of the context."""
        if max_tokens_auto:
            params.max_tokens = max(1, self.max_request_tokens - len(token_ids))
        req = self.scheduler.add_request(token_ids, params, uid=uid, arrival_time=arrival_time)
        self.tp_leader.requests_added([req])
        return req

    def abort(self, uid: int) -> StepOutput | None:
        """End a request wherever it is; None if it is unknown or already done."""
        out = self.scheduler.abort(uid)
        if out is not None:
            self.tp_leader.request_aborted(uid)
        return out

    def step(self) -> list[StepOutput]:
        return self.tp_leader.step(self.scheduler)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def drain(self) -> None:
        """Step until nothing runs or flies (a pass still in flight after an abort)."""
        while self.has_work:
            self.step()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks; a no-op with tp = 1."""
        self.tp_leader.shutdown()
