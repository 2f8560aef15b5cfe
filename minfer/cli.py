"""`minfer serve | generate | shell | bench | trace` — every flag comes from config.py.

A user's mistake (a model that is not there, an option value no run can use, a busy port) is
one line on stderr and exit code 2; `--debug` or MINFER_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from minfer import __version__
from minfer.config import (
    ConfigError,
    EngineConfig,
    ModelNotFoundError,
    ServerConfig,
    add_config_args,
    aliases_of,
    config_from_kwargs,
)

USER_ERRORS = (ConfigError, ModelNotFoundError)
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))
SERVER_FIELDS = tuple(f.name for f in dataclasses.fields(ServerConfig))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in the help, except where the help already says its default or there
    is none to say (argparse would print "(default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help or action.default in (None, argparse.SUPPRESS):
            return help
        return super()._get_help_string(action)


def _add_parser(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
    p.set_defaults(parser=p)  # an unknown flag is reported with this subcommand's usage
    return p


def _engine_parser(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = _add_parser(sub, name, help)
    model_help = (
        "a Hugging Face directory or model id (ORG/NAME), a .gguf file, or a shipped shape name "
        "(qwen3-0.6b, llama-3.1-8b; dummy weights) (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument(
        "--model",
        *aliases_of("model"),
        dest="model_option",
        metavar="MODEL",
        default=None,
        help="the model argument as a flag (vLLM's --model, SGLang's --model-path) (default: the positional one)",
    )
    add_config_args(p, EngineConfig, skip=("model",))
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (or MINFER_DEBUG=1)")
    return p


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    values = {k: v for k, v in vars(args).items() if k in ENGINE_FIELDS}
    if args.model_option is not None:
        if args.model is not None and args.model != args.model_option:
            raise ConfigError(f"two models given: {args.model!r} and --model {args.model_option!r}")
        values["model"] = args.model_option
    return config_from_kwargs(EngineConfig, values)


def _bench_serve_parser(bench_sub) -> argparse.ArgumentParser:
    from minfer.bench.serve_args import add_serve_args

    p = bench_sub.add_parser(
        "serve",
        help="online benchmark of a running server (Poisson arrivals, streaming)",
        formatter_class=HelpFormatter,
    )
    add_serve_args(p)

    def one_line_error(message: str):  # a bad flag is one line, not the whole usage text
        p.exit(2, f"minfer bench serve: error: {message}\n")

    p.error = one_line_error
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minfer", description="A compact, fast LLM serving engine")
    parser.add_argument("--version", action="version", version=f"minfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = _engine_parser(sub, "generate", "generate a completion for one prompt and print it")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass")
    gen.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 = all")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    gen.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of this request's sampling (default: --seed)"
    )

    serve = _engine_parser(sub, "serve", "start the OpenAI-compatible HTTP server")
    add_config_args(serve, ServerConfig)

    _engine_parser(sub, "shell", "chat with a model in the terminal")

    bench = _add_parser(sub, "bench", "benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = _engine_parser(bench_sub, "offline", "offline throughput (nano-vllm's workload)")
    from minfer.bench.offline import add_workload_args

    add_workload_args(offline)
    shared = _engine_parser(
        bench_sub, "shared-prefix", "prefix-cache workload: one system prompt, many questions"
    )
    from minfer.bench import shared_prefix

    shared_prefix.add_workload_args(shared)
    multiturn = _engine_parser(
        bench_sub, "multiturn", "multi-turn conversations outgrowing the device KV pool (host KV tier)"
    )
    from minfer.bench import multiturn as multiturn_bench

    multiturn_bench.add_workload_args(multiturn)
    _bench_serve_parser(bench_sub)
    from minfer.observability.trace_cli import add_trace_parser

    add_trace_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    subcommand_parser = vars(args).pop("parser", parser)  # not an option: keep it out of args
    if unknown:
        subcommand_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    debug = getattr(args, "debug", False) or os.environ.get("MINFER_DEBUG", "") not in ("", "0")
    try:
        return _run(args)
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"minfer: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from minfer.server.launch import bind_http_socket, serve

        server_cfg = _server_config(args)
        # Bound before a model load of minutes; a worker node of a multi-node job serves no HTTP.
        listener = (
            bind_http_socket(server_cfg.host, server_cfg.port)
            if vars(args).get("node_rank", 0) == 0
            else None
        )
        engine_cfg, served_as = _preflight(_engine_config(args))
        server_cfg.served_model_name = server_cfg.served_model_name or served_as
        return serve(engine_cfg, server_cfg, listener)
    if args.command == "trace":
        from minfer.observability.trace_cli import run_trace

        return run_trace(args)
    if args.command == "bench" and args.bench_command == "serve":
        from minfer.bench.serve import run_serve_bench

        return run_serve_bench(args)
    engine_cfg, _ = _preflight(_engine_config(args))
    if args.command == "generate":
        return _generate(engine_cfg, args)
    if args.command == "shell":
        from minfer.server.shell import run_shell

        return run_shell(engine_cfg)
    if args.bench_command == "shared-prefix":
        from minfer.bench.shared_prefix import run_shared_prefix_bench

        return run_shared_prefix_bench(engine_cfg, args)
    if args.bench_command == "multiturn":
        from minfer.bench.multiturn import run_multiturn_bench

        return run_multiturn_bench(engine_cfg, args)
    from minfer.bench.offline import run_offline_bench

    return run_offline_bench(engine_cfg, args)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    values = {k: v for k, v in vars(args).items() if k in SERVER_FIELDS}
    names = values.get("served_model_name")
    if names is not None:  # nargs="+", so that a second name is never taken for the model path
        if len(names) > 1:
            raise ConfigError(
                f"--served-model-name {' '.join(names)}: minfer serves one model under one name; give one"
            )
        values["served_model_name"] = names[0]
    return config_from_kwargs(ServerConfig, values)


def _preflight(cfg: EngineConfig) -> tuple[EngineConfig, str | None]:
    """Check the model and the options against it before any process starts or weight loads.
    A Hugging Face id is downloaded here, once, and the workers get its local directory; the
    id stays the name it is served as."""
    from minfer.models.source import model_source  # torch-free: the api server process stays without it

    if cfg.trust_remote_code:
        print(
            "minfer: note: --trust-remote-code changes nothing: minfer runs no code from model repositories",
            file=sys.stderr,
        )
    source = model_source(cfg)
    if cfg.tp > 1:
        from minfer.models.loader import load_hf_config

        check_tp_fits(load_hf_config(source), cfg.tp)
        check_tp_gpus(cfg)
    if cfg.model is not None and not os.path.exists(cfg.model) and source.load_format != "dummy":
        return dataclasses.replace(cfg, model=source.path), cfg.model
    return cfg, None


def check_tp_fits(hf_config, tp: int) -> None:
    """The shards --tp needs: whole heads and MLP columns on every rank (layers/linear.py)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ConfigError(
            f"--tp {tp}: the model's {heads} attention heads do not split into {tp} equal parts"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ConfigError(
            f"--tp {tp}: the model's {kv_heads} KV heads neither split into {tp} parts nor divide {tp}"
        )
    if hf_config.intermediate_size % tp:
        raise ConfigError(
            f"--tp {tp}: the model's MLP width {hf_config.intermediate_size} does not split into {tp} parts"
        )


def check_tp_gpus(cfg: EngineConfig) -> None:
    """A GPU for every rank of this node, before `serve` starts any process (the ranks check
    again when they join: parallel.join_tp_group). torch is already imported here for --tp."""
    import torch

    from minfer.distributed.parallel import RankLayout

    if cfg.device != "cpu" and torch.cuda.is_available():
        RankLayout.of(cfg).check_gpus(torch.cuda.device_count())


def _generate(engine_cfg: EngineConfig, args: argparse.Namespace) -> int:
    from minfer import LLM, SamplingParams
    from minfer.core import InvalidRequestError

    llm = LLM(**vars(engine_cfg))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
    )
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
