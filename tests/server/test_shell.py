"""`minfer shell` in-process with a tiny model: history across turns, /reset, /exit."""

from __future__ import annotations

import builtins

from minfer.config import EngineConfig
from minfer.llm import LLM
from minfer.server import shell
from minfer.server.shell import fit_history, run_shell


def test_history_reset_exit(tiny_chat_model, monkeypatch, capsys):
    seen: list[list[dict]] = []
    original = LLM.apply_chat_template

    def recording(self, messages):
        seen.append([dict(m) for m in messages])
        return original(self, messages)

    monkeypatch.setattr(LLM, "apply_chat_template", recording)
    monkeypatch.setattr(shell, "MAX_REPLY_TOKENS", 16)  # short replies: the history always fits
    lines = iter(["/temp 0", "first question", "second question", "/reset", "third question", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert run_shell(EngineConfig(model=tiny_chat_model, kv_cache_tokens=8192, max_model_len=512)) == 0
    assert [[m["role"] for m in conv] for conv in seen] == [["user"], ["user", "assistant", "user"], ["user"]]
    assert seen[1][0]["content"] == "first question" and seen[1][2]["content"] == "second question"
    assert seen[2][0]["content"] == "third question"
    out = capsys.readouterr().out
    assert "(temperature 0.0)" in out and "(conversation cleared)" in out


def test_fit_history_drops_oldest_exchanges(tiny_chat_model):
    llm = LLM(tiny_chat_model, kv_cache_tokens=4096, max_model_len=128)
    history = []
    for i in range(20):
        history += [
            {"role": "user", "content": f"question {i} " * 5},
            {"role": "assistant", "content": "answer " * 5},
        ]
    history.append({"role": "user", "content": "last"})
    ids = fit_history(llm, history)
    assert len(ids) < 128 - 16
    assert history[-1]["content"] == "last" and history[0]["role"] == "user"
    assert len(history) % 2 == 1 and len(history) < 41


def test_shell_reply_at_tp2_equals_tp1(tiny_chat_model):
    """The shell drives its requests through the Runner: with tp=2 the other rank gets them too
    (it used to call the scheduler directly, so rank 1 never saw the request and diverged)."""
    from minfer.core import SamplingParams
    from minfer.server.shell import stream_reply

    replies = []
    for tp in (1, 2):
        llm = LLM(tiny_chat_model, kv_cache_tokens=2048, max_model_len=256, tp=tp, log_level="warning")
        ids = llm.apply_chat_template([{"role": "user", "content": "hello there"}])
        replies.append(
            stream_reply(
                llm,
                ids,
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                write=lambda _text: None,
            )
        )
        llm.shutdown()
    assert replies[0] == replies[1] and replies[0]


def test_line_editing_history_help_and_quiet_banner(tiny_chat_model, tmp_path):
    """The real `minfer shell` on a terminal (a pty): arrow keys recall and edit the previous line
    (readline), /help lists the commands, and no log line comes before the banner."""
    import os
    import sys

    import pexpect
    from server_harness import REPO

    history = tmp_path / "history"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm", "MINFER_SHELL_HISTORY": str(history)}
    args = ["-m", "minfer", "shell", tiny_chat_model, "--kv-cache-tokens", "2048", "--max-model-len", "256"]
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=120, cwd=str(REPO))
    try:
        child.expect("minfer shell — ")
        assert child.before.strip() == "", child.before  # nothing above the banner
        child.expect(">>> ")
        child.send("/help\r")
        child.expect("/reset +clear the conversation")
        child.expect(">>> ")
        child.send("/temp 0.5\r")
        child.expect(r"\(temperature 0.5\)")
        child.expect(">>> ")
        child.send("\x1b[A\x7f25\r")  # Up recalls "/temp 0.5", Backspace, then "25"
        child.expect(r"\(temperature 0.25\)")
        child.expect(">>> ")
        child.send("/exit\r")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert history.read_text().splitlines()[-3:] == ["/temp 0.5", "/temp 0.25", "/exit"]
