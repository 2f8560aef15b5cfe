"""SGLang's POST /generate: `text` or `input_ids`, one prompt or a batch; cumulative text when streamed."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request

from minfer.ipc import messages as m
from minfer.server.driver import Choice, Driver, Job
from minfer.server.errors import ERROR_RESPONSES
from minfer.server.generate_protocol import GenerateRequestBody
from minfer.server.logprobs import sglang_logprobs
from minfer.server.state import ServerState, server_state

router = APIRouter(responses=ERROR_RESPONSES)


class GenerateShape:
    """`{text, output_ids, meta_info}` per prompt (a list for a batch)."""

    def __init__(self, body: GenerateRequestBody, rid: str, batched: bool):
        self.body, self.rid, self.batched = body, rid, batched
        self.arrival = time.monotonic()

    def result(self, index: int, c: Choice) -> dict:
        reason = None
        if c.finish_reason == "length":
            reason = {"type": "length", "length": c.completion_tokens}
        elif c.finish_reason is not None:
            reason = {"type": c.finish_reason, "matched": c.stop_reason}
        end = c.finish_time if c.finish_time is not None else time.monotonic()
        first = c.first_token_time
        timings = {
            "queue_s": c.queue_s,
            "prefill_s": c.prefill_s,
            "first_token_s": None if first is None else first - self.arrival,
            "decode_s": None if first is None else end - first,
            "e2e_s": end - self.arrival,
        }
        meta = {
            "id": self.rid if not self.batched else f"{self.rid}-{index}",
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens,  # SGLang's: prompt tokens the prefix cache held
            "finish_reason": reason,
            "e2e_latency": timings["e2e_s"],
            "timings": timings,
        }
        body = self.body
        if body.return_logprob:
            with_text = body.return_text_in_logprobs
            meta["output_token_logprobs"], meta["output_top_logprobs"] = sglang_logprobs(
                c.logprobs, 0, with_text
            )
            if c.prompt_logprobs is not None:
                meta["input_token_logprobs"], meta["input_top_logprobs"] = sglang_logprobs(
                    c.prompt_logprobs, body.logprob_start_len, with_text
                )
        return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}

    def build(self, choices: dict[int, Choice]) -> dict | list:
        results = [self.result(i, c) for i, c in sorted(choices.items())]
        return results if self.batched else results[0]

    def opening(self, choices):
        return ()

    def chunk(self, index: int, reply: m.Reply, choices: dict[int, Choice]) -> dict | None:
        if not reply.text and reply.finish_reason is None:
            return None
        out = self.result(index, choices[index])
        if self.batched:
            out["index"] = index
        return out

    def closing(self, choices):
        return ()


@router.post("/generate")
async def generate(body: GenerateRequestBody, request: Request, state: ServerState = Depends(server_state)):
    prompts, batched = body.prompts()
    params, auto = body.params(state.sampling_defaults)
    rid = body.rid or uuid.uuid4().hex
    job = Job(
        rid,
        prompts,
        params,
        auto,
        timeout=body.timeout,
        prompt_only=body.prompt_only,
        prompt_param="text" if body.text is not None else "input_ids",
    )
    return await Driver(state, request, job).respond(GenerateShape(body, rid, batched), body.stream)
