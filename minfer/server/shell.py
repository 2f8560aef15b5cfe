"""`minfer shell`: chat with a model in the terminal, the reply streamed as it is generated.

The engine runs in this process (no server); the conversation is kept across turns and
rendered with the model's chat template each turn, so the prefix cache reuses the history's KV.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from minfer.config import EngineConfig
from minfer.core import InvalidRequestError, SamplingParams
from minfer.tokenizer.detokenizer import IncrementalDetokenizer

HELP = "Type a message and press Enter; /help lists the commands."
COMMANDS = """\
  /help      this list
  /reset     clear the conversation
  /temp T    sampling temperature (0 = greedy; default: the model's generation_config.json, else 0.7)
  /exit      quit (also /quit, Ctrl-D)
Arrow keys edit the line and walk the history (kept in $MINFER_SHELL_HISTORY, default ~/.minfer_shell_history);
Ctrl-C stops a reply."""
HISTORY_LENGTH = 1000
# A chat in a terminal wants some variety but stays on topic; a model's generation_config.json
# values, where it has them, come first (the maker tuned them for its chats).
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.9}
MAX_REPLY_TOKENS = 1024


def stream_reply(llm, prompt_ids: list[int], params: SamplingParams, write=sys.stdout.write) -> str:
    """Generate one reply, writing each final piece of text as it comes; Ctrl-C stops it early."""
    runner = llm.runner  # through the Runner, so that tensor-parallel ranks get the request too
    req = runner.add(prompt_ids, params)
    detok = IncrementalDetokenizer(llm.tokenizer)
    try:
        done = False
        while not done:
            for out in runner.step():
                if out.uid != req.uid:
                    continue
                if out.token_id is not None:
                    write(detok.add(out.token_id))
                    sys.stdout.flush()
                done = done or out.finish_reason is not None
    except KeyboardInterrupt:
        runner.abort(req.uid)
        runner.drain()  # let a pass still in flight finish
        write(" [stopped]")
    write(detok.flush() + "\n")
    return detok.text


def fit_history(llm, history: list[dict]) -> list[int]:
    """The prompt of the conversation, dropping the oldest exchanges until a reply still fits."""
    limit = llm.engine.max_model_len
    while True:
        first = 1 if history[0]["role"] == "system" else 0
        try:
            ids = llm.apply_chat_template(history)
        except InvalidRequestError as e:  # the intake refuses what is certainly too long
            if e.code != "context_length_exceeded" or len(history) - first <= 1:
                raise
            ids = None
        if ids is not None and (len(ids) < limit - 16 or len(history) - first <= 1):
            return ids
        del history[first : first + 2]  # a user turn and its answer


def enable_line_editing() -> None:
    """Line editing and a history across sessions for input(), from Python's readline module
    (absent on some platforms: the shell then works without them)."""
    try:
        import readline
    except ImportError:
        return
    import atexit

    path = os.environ.get("MINFER_SHELL_HISTORY") or os.path.expanduser("~/.minfer_shell_history")
    try:
        readline.read_history_file(path)
    except OSError:
        pass  # the first session
    readline.set_history_length(HISTORY_LENGTH)
    atexit.register(_save_history, readline, path)


def _save_history(readline, path: str) -> None:
    try:
        readline.write_history_file(path)
    except OSError:
        pass  # a read-only home must not turn quitting into a traceback


def run_shell(engine_cfg: EngineConfig) -> int:
    from minfer.llm import LLM

    # Loading logs its progress at info; above the banner it only pushes the banner off screen.
    # The default level becomes warning here; an explicit --log-level debug still shows them.
    if engine_cfg.log_level == EngineConfig.log_level:
        engine_cfg = dataclasses.replace(engine_cfg, log_level="warning")
    llm = LLM(**dataclasses.asdict(engine_cfg))
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        print(f"minfer shell: model {llm.engine.source.name!r} has no chat template", file=sys.stderr)
        return 2
    print(f"minfer shell — {llm.engine.source.name}, context {llm.engine.max_model_len} tokens. {HELP}")
    enable_line_editing()
    history: list[dict] = []
    sampling = {**DEFAULT_SAMPLING, **llm.engine.sampling_defaults}
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/help":
            print(COMMANDS)
            continue
        if command == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if command.startswith("/temp"):
            try:
                temperature = float(command.split()[1])
                SamplingParams(temperature=temperature).validate()
                sampling["temperature"] = temperature
                print(f"(temperature {temperature})")
            except (IndexError, ValueError) as e:
                print(f"usage: /temp T with T >= 0 ({e})")
            continue
        if command.startswith("/"):
            print(f"unknown command {command!r}. {HELP}")
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = fit_history(llm, history)
            room = llm.engine.max_model_len - len(ids)
            params = SamplingParams(**sampling, max_tokens=max(1, min(MAX_REPLY_TOKENS, room)))
            reply = stream_reply(llm, ids, params)
        except InvalidRequestError as e:
            print(f"error: {e}")
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
