"""The offline API: `LLM(model).generate(prompts, params)` runs requests to completion in-process."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

from minfer.config import EngineConfig, config_from_kwargs
from minfer.core import FinishReason, InvalidRequestError, RequestOutput, SamplingParams, TokenLogprobs
from minfer.engine.engine import Engine
from minfer.runner.ranks import run_worker_node
from minfer.runner.runner import Runner
from minfer.tokenizer.detokenizer import IncrementalDetokenizer
from minfer.tokenizer.intake import PromptEncoder, with_bad_words_ids

log = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """An engine and its scheduler in this process.

    `LLM(model, **options)` takes every option of `EngineConfig` by its field name, the same
    names as the CLI flags (`page_size`, `kv_cache_tokens`, `chunked_prefill_size`, ...).
    """

    def __init__(self, model: str | None = None, **options):
        self.config: EngineConfig = config_from_kwargs(EngineConfig, {"model": model, **options})
        logging.basicConfig(level=self.config.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
        if self.config.node_rank > 0:  # a worker node of a multi-node job has nothing else to do
            raise SystemExit(run_worker_node(self.config))
        # With tp > 1 this process is rank 0 and starts this node's other ranks.
        self.runner = Runner(self.config)
        weakref.finalize(self, self.runner.shutdown)
        self.engine: Engine = self.runner.engine
        self.scheduler = self.runner.scheduler
        self.intake = PromptEncoder(self.engine.tokenizer, self.runner.max_request_tokens - 1)
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (also done at exit); a no-op with tp=1."""
        self.runner.shutdown()

    # -- prompts: through the same intake as the server's tokenizer worker ----------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.intake.encode(prompt=prompt)
        return list(prompt)

    def apply_chat_template(
        self,
        messages: list[dict],
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a conversation under the model's chat template; `chat_template_kwargs`
        are extra template variables (Qwen3: {"enable_thinking": False}); with
        `continue_final_message` (and add_generation_prompt False) the model goes on with the
        last, assistant, message."""
        return self.intake.encode(
            messages=messages,
            template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    # -- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._param_list(len(prompts), sampling_params)
        return self._generate([self._prompt_ids(p, sp) for p, sp in zip(prompts, params)], params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(c, chat_template_kwargs, add_generation_prompt, continue_final_message)
            for c in conversations
        ]
        return self.generate_ids(prompts, sampling_params, use_tqdm)

    def default_sampling_params(self) -> SamplingParams:
        """What a prompt without SamplingParams gets: the model's generation_config.json sampling
        values (vLLM's `get_default_sampling_params`), else SamplingParams' defaults."""
        return SamplingParams(**self.engine.sampling_defaults)

    def _param_list(
        self, count: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        """One SamplingParams per prompt (the default's, or one given for all), each validated:
        all or nothing, before any prompt is tokenized or queued."""
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * count
        else:
            params = list(sampling_params)
        if len(params) != count:
            raise InvalidRequestError(f"{count} prompts but {len(params)} sampling params")
        for p in params:
            p.validate()
        return params

    def _prompt_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """A prompt's token ids, cut to params.truncate_prompt_tokens (a text as it is tokenized,
        so a text over the context is not refused)."""
        keep_last = self.intake.keep_last(params)
        if isinstance(prompt, str):
            return self.intake.encode(prompt=prompt, keep_last=keep_last)
        return prompt if keep_last is None else self.intake.encode(prompt_ids=prompt, keep_last=keep_last)

    def generate_ids(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        params = self._param_list(len(prompts), sampling_params)
        return self._generate([self._prompt_ids(p, sp) for p, sp in zip(prompts, params)], params, use_tqdm)

    def _generate(
        self, prompts: list[list[int]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Run token-id prompts with their validated params to completion."""
        runner = self.runner
        params = [with_bad_words_ids(self.tokenizer, p) for p in params]
        reqs = [runner.add(ids, p) for ids, p in zip(prompts, params)]
        pending = {r.uid for r in reqs}
        by_uid = {r.uid: r for r in reqs}
        bar = None
        if use_tqdm and len(reqs) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generating", unit="req")
        logprobs = {r.uid: TokenLogprobs() for r in reqs if r.params.logprobs is not None}
        prompt_logprobs = {}
        # Stop strings are found in the text, as the server's detokenizer worker does: the request
        # ends (its KV freed at once) with the token that completes one, and the text stops before
        # it. A text that keeps special tokens is made there too (its last token's rule: add_final).
        stop_texts = {
            r.uid: IncrementalDetokenizer(
                self.tokenizer,
                r.params.stop,
                skip_special_tokens=r.params.skip_special_tokens,
                keep_stop=r.params.include_stop_str_in_output,
            )
            for r in reqs
            if (r.params.stop or not r.params.skip_special_tokens) and self.tokenizer is not None
        }
        while pending:
            for out in runner.step():
                detok = stop_texts.get(out.uid)
                if detok is not None and out.token_id is not None:
                    detok.add_final(out.token_id, out.finish_reason == FinishReason.STOP)
                    if detok.matched_stop is not None and not out.finish_reason:
                        runner.abort(out.uid)
                        out.finish_reason = FinishReason.STOP
                    if out.finish_reason:
                        by_uid[out.uid].finish_reason = (
                            FinishReason.STOP if detok.matched_stop else out.finish_reason
                        )
                if out.logprobs is not None and out.uid in logprobs:
                    logprobs[out.uid].extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.uid] = out.prompt_logprobs
                if out.finish_reason and out.uid in pending:
                    pending.discard(out.uid)
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [
            RequestOutput(
                r.uid,
                r.token_ids[: r.prompt_len],
                r.output_ids,
                stop_texts[r.uid].text if r.uid in stop_texts else self.decode(r.output_ids),
                r.finish_reason,
                logprobs.get(r.uid),
                prompt_logprobs.get(r.uid),
                r.prefix_hit,
            )
            for r in reqs
        ]
