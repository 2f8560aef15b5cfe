"""What the api server knows: its client of the workers and what they reported at start-up."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from fastapi import Request

from minfer.config import EngineConfig, ServerConfig
from minfer.ipc.process import dead_workers
from minfer.server.client import EngineClient, RequestGroup
from minfer.server.errors import APIError


@dataclass
class ServerState:
    client: EngineClient
    model_name: str
    engine_config: EngineConfig
    server_config: ServerConfig
    scheduler_info: dict
    tokenizer_info: dict
    workers: dict[str, BaseProcess]
    healthy: bool = True
    exit_code: int = 0
    groups: dict[str, RequestGroup] = field(default_factory=dict)  # rid -> requests, for /abort_request
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_model_len(self) -> int:
        return self.scheduler_info["max_model_len"]

    @property
    def sampling_defaults(self) -> dict:
        """The model's generation_config.json sampling values, for fields a request leaves unset."""
        return self.scheduler_info.get("sampling_defaults", {})

    @property
    def reasoning(self) -> tuple[str | None, int | None]:
        """(--reasoning-parser, None for none; the `</think>` token's id, None where it is not
        one token): how the chat and responses shapes split an answer and count its reasoning."""
        parser = self.server_config.reasoning_parser
        return (None if parser == "none" else parser), self.tokenizer_info.get("reasoning_end_id")

    def alive(self) -> bool:
        return self.healthy and all(p.is_alive() for p in self.workers.values())

    def why_dead(self) -> str:
        return "; ".join(dead_workers(self.workers)) or "shutting down"

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )


async def server_state(request: Request) -> ServerState:
    """The endpoints' dependency: the state build_app put on the app.

    Async on purpose: FastAPI runs a plain `def` dependency in its thread pool, a thread hop
    per request (and up to 40 threads under a burst): GET /v1/models took 550 instead of ~400
    us on a 2-core machine (scripts/api_request_cost.py)."""
    return request.app.state.minfer
