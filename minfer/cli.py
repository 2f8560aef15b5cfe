"""`minfer serve | generate | shell | bench | trace` — every flag comes from config.py."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from minfer.config import EngineConfig, ServerConfig, add_config_args, config_from_kwargs


def _engine_parser(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "model", nargs="?", default=None, help="model path or shipped shape name (default: SmolLM2)"
    )
    add_config_args(p, EngineConfig, skip=("model",))
    return p


def _engine_config(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> EngineConfig:
    values = {k: v for k, v in vars(args).items() if k not in ("command", *extra)}
    return config_from_kwargs(EngineConfig, values, strict=False)


def _bench_serve_parser(bench_sub) -> argparse.ArgumentParser:
    from minfer.bench.serve_args import add_serve_args

    p = bench_sub.add_parser(
        "serve",
        help="online benchmark of a running server (Poisson arrivals, streaming)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_args(p)

    def one_line_error(message: str):  # a bad flag is one line, not the whole usage text
        p.exit(2, f"minfer bench serve: error: {message}\n")

    p.error = one_line_error
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minfer", description="A compact, fast LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = _engine_parser(sub, "generate", "generate a completion for one prompt and print it")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")

    serve = _engine_parser(sub, "serve", "start the OpenAI-compatible HTTP server")
    add_config_args(serve, ServerConfig)

    _engine_parser(sub, "shell", "chat with a model in the terminal")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = _engine_parser(bench_sub, "offline", "offline throughput (nano-vllm's workload)")
    from minfer.bench.offline import add_workload_args

    add_workload_args(offline)
    shared = _engine_parser(
        bench_sub, "shared-prefix", "prefix-cache workload: one system prompt, many questions"
    )
    from minfer.bench import shared_prefix

    shared_prefix.add_workload_args(shared)
    _bench_serve_parser(bench_sub)
    from minfer.observability.trace_cli import add_trace_parser

    add_trace_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        from minfer.server.launch import serve

        server_names = tuple(f.name for f in dataclasses.fields(ServerConfig))
        server_cfg = config_from_kwargs(
            ServerConfig, {k: v for k, v in vars(args).items() if k in server_names}
        )
        return serve(_engine_config(args, server_names), server_cfg)
    if args.command == "shell":
        from minfer.server.shell import run_shell

        return run_shell(_engine_config(args))
    if args.command == "bench" and args.bench_command == "serve":
        from minfer.bench.serve import run_serve_bench

        return run_serve_bench(args)
    if args.command == "bench" and args.bench_command == "shared-prefix":
        from minfer.bench.shared_prefix import WORKLOAD_ARGS, run_shared_prefix_bench

        return run_shared_prefix_bench(_engine_config(args, ("bench_command", *WORKLOAD_ARGS)), args)
    if args.command == "bench":
        from minfer.bench.offline import WORKLOAD_ARGS, run_offline_bench

        return run_offline_bench(_engine_config(args, ("bench_command", *WORKLOAD_ARGS)), args)
    if args.command == "trace":
        from minfer.observability.trace_cli import run_trace

        return run_trace(args)
    return 2


def _generate(args: argparse.Namespace) -> int:
    from minfer import LLM, SamplingParams
    from minfer.core import InvalidRequestError

    extra = ("prompt", "chat", "max_tokens", "temperature", "top_p", "top_k", "min_p", "sampling_seed")
    llm = LLM(**vars(_engine_config(args, extra)))
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
