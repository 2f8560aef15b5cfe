"""Every user mistake is one line on stderr and exit code 2; --debug / MINFER_DEBUG=1 show the
traceback. None of these load a model."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from cli_harness import assert_one_line_error, minfer

from minfer.config import ConfigError
from minfer.distributed.parallel import RankLayout


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"], ["shell"]])
def test_a_wrong_model_path_is_one_line(command):
    result = minfer(command[0], "/no/such/model", *command[1:])
    assert_one_line_error(result, "'/no/such/model' not found")


@pytest.mark.parametrize("env, flag", [({}, "--debug"), ({"MINFER_DEBUG": "1"}, None)])
def test_debug_shows_the_traceback(env, flag):
    result = minfer("generate", "/no/such/model", "--prompt", "hi", *([flag] if flag else []), env=env)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ModelNotFoundError" in result.stderr


def test_tp_that_does_not_divide_the_heads_is_one_line(tmp_path):
    from tiny_models import tiny_hf_config

    # Only the config: the check runs before any weight is read.
    tiny_hf_config("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72).save_pretrained(
        tmp_path
    )
    result = minfer("generate", str(tmp_path), "--prompt", "hi", "--tp", "2")
    assert_one_line_error(result, "--tp 2", "9 attention heads")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_device_cuda_without_one_is_one_line():
    assert_one_line_error(
        minfer("generate", "--device", "cuda", "--prompt", "hi"), "--device cuda", "no CUDA device"
    )


def test_tp_with_fewer_gpus_than_ranks_is_refused():
    """Checked by `serve`'s preflight and by every rank before it meets the others (a rank
    without a GPU used to fail after rank 0 had counted it, and rank 0 waited in NCCL)."""
    RankLayout(tp=2, nnodes=1, node_rank=0).check_gpus(2)
    with pytest.raises(
        ConfigError, match="this machine runs 2 ranks, one GPU each, but torch sees 1 GPU here"
    ):
        RankLayout(tp=2, nnodes=1, node_rank=0).check_gpus(1)
    with pytest.raises(
        ConfigError, match="each of the 2 nodes runs 4 ranks, one GPU each, but torch sees 3 GPUs"
    ):
        RankLayout(tp=8, nnodes=2, node_rank=1).check_gpus(3)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--page-size", "0"], "--page-size=0 must be >= 1"),
        (["--mem-fraction", "1.5"], "--mem-fraction=1.5 must be in [0.01, 1]"),
        (["--kv-cache-tokens", "-1"], "--kv-cache-tokens=-1 must be >= 1"),
        (["--quantization", "awq"], "minfer cannot run quantized weights"),
        (["--cpu-threads", "0"], "--cpu-threads=0 must be in [1, 4096]"),
        (["--quantization", "gguf", "--device", "cpu", "qwen3-0.6b"], "needs a .gguf model"),
        (["--chat-template", "no-such-template.jinja"], "neither a file nor a Jinja template"),
        (["--tokenizer", "/no/such/tokenizer"], "is not a directory"),
        (
            ["--max-model-len", "9000"],
            "--max-model-len 9000 is longer than the model's context of 8192 tokens",
        ),
    ],
)
def test_bad_option_values_are_one_line(flags, message):
    assert_one_line_error(minfer("generate", "--prompt", "hi", *flags), message)


def test_a_busy_port_is_refused_before_anything_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        # A model that does not exist: had the model come first, this would name the model.
        result = minfer("serve", "/no/such/model", "--port", str(port))
    assert_one_line_error(result, f"127.0.0.1:{port}", "in use")
    assert "loading" not in result.stdout
    assert time.monotonic() - started < 30


def test_an_unknown_flag_prints_the_subcommands_usage():
    result = minfer("serve", "--no-such-flag")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: minfer serve ")
    assert result.stderr.rstrip().endswith("minfer serve: error: unrecognized arguments: --no-such-flag")


def test_version():
    result = minfer("--version")
    assert result.returncode == 0 and result.stdout.startswith("minfer 0.")


@pytest.mark.parametrize(
    "command",
    [
        ["serve"],
        ["generate"],
        ["shell"],
        ["bench", "offline"],
        ["bench", "shared-prefix"],
        ["bench", "serve"],
    ],
)
def test_help_shows_every_flags_default_and_help(command):
    from minfer.cli import build_parser

    result = minfer(*command, "--help")
    assert result.returncode == 0
    assert "(default: None)" not in result.stdout
    parser = build_parser()
    for name in command:  # walk down to the subcommand's parser
        parser = next(a for a in parser._actions if a.dest in ("command", "bench_command")).choices[name]
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
            shows_default = (
                action.required or "default" in action.help or action.default not in (None, "==SUPPRESS==")
            )
            assert shows_default, f"{action.option_strings} does not say its default"
