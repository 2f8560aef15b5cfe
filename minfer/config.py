"""Every option minfer has, defined once.

The CLI flags, the keyword arguments of `LLM(...)` and the server's settings are all
generated from these dataclasses: a field `page_size` is the flag `--page-size` and the
keyword `page_size=`. Help text lives in each field's metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field

from minfer.defaults import (  # noqa: F401 (re-exported: the defaults are part of the options' story)
    CPU_DEFAULT_KV_CACHE_TOKENS,
    CPU_DEFAULT_MAX_RUNNING_REQUESTS,
    DEFAULT_MAX_RUNNING_REQUESTS,
    default_chunked_prefill_size,
    default_max_running_requests,
)


class ConfigError(ValueError):
    """A user's option value that minfer refuses; the CLI prints it as one line (exit code 2)."""


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local path, a shipped shape, nor a (cached) Hugging Face repo."""


def _opt(default, help: str, choices: tuple | None = None, nargs: str | None = None):
    return field(default=default, metadata={"help": help, "choices": choices, "nargs": nargs})


# --quantization values (minfer/models/quantize.py applies them)
QUANTIZATION_METHODS = ("none", "gguf", "int4", "int8")


@dataclass
class EngineConfig:
    """Options of the engine: model loading, KV cache, scheduling, kernels."""

    model: str | None = _opt(
        None,
        "HF directory, .gguf file, or a shipped shape name (qwen3-0.6b, llama-3.1-8b); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    revision: str | None = _opt(
        None, "Hugging Face model id only: branch, tag or commit to download (default: main)"
    )
    download_dir: str | None = _opt(
        None, "Hugging Face model id only: cache directory (default: the hub's, ~/.cache/huggingface/hub)"
    )
    tokenizer: str | None = _opt(
        None, "directory of the tokenizer to use instead of the model's (default: the model's)"
    )
    chat_template: str | None = _opt(
        None,
        "chat template used instead of the tokenizer's: a Jinja file, or the template itself "
        "(a string containing {{ or {%%) (default: the tokenizer's)",
    )
    generation_config: str = _opt(
        "auto",
        "sampling defaults for requests that leave a field unset: auto = the model folder's "
        "generation_config.json (its maker's temperature, top_p, top_k, min_p, repetition_penalty), "
        "none = minfer's own (temperature 1, no truncation), or a folder with a generation_config.json; "
        "the end-of-turn token ids the model folder's file names apply either way (default: auto)",
    )
    quantization: str | None = _opt(
        None,
        "low-bit weights for CPU decode: gguf = a .gguf file's Q4_0/Q4_1 blocks as they are, int4 / int8 = "
        "quantize a float checkpoint's linear layers at load; none = float weights (a .gguf file is "
        "dequantized to float32) (default: none)",
    )
    cpu_threads: int | None = _opt(
        None,
        "torch threads of each process that runs the model: on CPU the default is OMP_NUM_THREADS when set, "
        "else the cores in the process's affinity, os.sched_getaffinity, divided among a node's TP ranks; "
        "on a GPU (where the CPU only keeps the books) 1",
    )
    trust_remote_code: bool = _opt(
        False,
        "accepted for vLLM/SGLang compatibility; minfer runs no code from model repositories "
        "(its own model classes only), so this changes nothing",
    )
    load_format: str = _opt("auto", "how to read the weights", ("auto", "safetensors", "gguf", "dummy"))
    dtype: str = _opt(
        "auto",
        "compute dtype; auto = the checkpoint's dtype on CUDA, float32 on CPU",
        ("auto", "float32", "bfloat16", "float16"),
    )
    device: str = _opt("auto", "auto = cuda when available, else cpu", ("auto", "cpu", "cuda"))
    max_model_len: int | None = _opt(None, "context length limit, at most the model's (default: the model's)")
    page_size: int = _opt(1, "KV cache page size in tokens")
    kv_cache_tokens: int | None = _opt(
        None, "KV pool size in tokens; overrides the measured size on CUDA (CPU default: 16384)"
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache storage: auto = the compute dtype; fp8_e4m3 = one byte per value with a static "
        "float32 scale per layer and kv head (half the bytes of bf16, twice the tokens; docs/MEMORY.md)",
        ("auto", "fp8_e4m3"),
    )
    host_kv_cache_gb: float = _opt(
        0.0,
        "GiB of host memory (pinned on CUDA) for a second KV cache tier behind the radix prefix cache: "
        "prefixes evicted from the device pool are written back there and loaded again on a hit "
        "(0: off; needs --cache radix; docs/MEMORY.md sizes it)",
    )
    host_kv_write_policy: str = _opt(
        "write_back",
        "when a device prefix gets its host copy: on eviction, or also on its second hit (docs/MEMORY.md)",
        ("write_back", "write_through"),
    )
    mem_fraction: float = _opt(0.90, "fraction of total device memory minfer may use (CUDA)")
    max_running_requests: int | None = _opt(
        None,
        f"cap on concurrently running requests (default: {DEFAULT_MAX_RUNNING_REQUESTS}, on CPU "
        f"{CPU_DEFAULT_MAX_RUNNING_REQUESTS}: where the CPU's throughput stops growing, docs/BENCHMARKS.md)",
    )
    max_queued_requests: int = _opt(
        1024,
        "serving: requests that may wait beyond max-running-requests; more are refused at once with 503 and "
        "Retry-After (0: none may wait; a large number: no practical limit)",
    )
    chunked_prefill_size: int | None = _opt(
        None,
        "token budget of one prefill step (8192; 2048 for --quantization on CPU); longer prompts span steps",
    )
    attention_backend: str = _opt(
        "auto",
        "auto = triton on CUDA, torch on CPU (sdpa with --quantization); torch = transformers' eager "
        "attention bit for bit; sdpa = torch's scaled_dot_product_attention for prompts, its sdpa "
        "attention bit for bit, faster on long CPU prompts",
        ("auto", "torch", "sdpa", "triton"),
    )
    cache: str = _opt(
        "radix", "prefix cache: radix shares prompt prefixes, naive shares nothing", ("radix", "naive")
    )
    schedule_policy: str = _opt(
        "fcfs", "order of admission: first come first served, or longest prefix match first", ("fcfs", "lpm")
    )
    tp: int = _opt(1, "tensor-parallel degree (one process per rank)")
    nnodes: int = _opt(1, "number of nodes the tensor-parallel ranks span (tp/nnodes ranks per node)")
    node_rank: int = _opt(0, "this node's index in [0, nnodes); node 0 runs rank 0, which serves requests")
    dist_init_addr: str | None = _opt(
        None,
        "HOST:PORT where rank 0 meets the other ranks (required with nnodes > 1; default: a free local port)",
    )
    cuda_graph_max_bs: int = _opt(256, "largest decode batch captured in a CUDA graph; 0 disables graphs")
    prefill_cuda_graph_max_tokens: int | None = _opt(
        None, "largest prefill pass replayed from CUDA graphs (default: --chunked-prefill-size; 0: none)"
    )
    disable_overlap_schedule: bool = _opt(
        False, "run the CPU scheduling and the GPU step one after the other"
    )
    check_kv_invariants: bool = _opt(
        False,
        "after every scheduler step, check that every KV page is owned exactly once (free, prefix "
        "cache, or one request) and stop loudly if not; slow, for debugging (env MINFER_CHECK_KV_INVARIANTS=1 "
        "turns it on too; the tests do)",
    )
    seed: int = _opt(0, "seed for requests that do not bring their own")
    trace_requests: str | None = _opt(
        None, "write a JSONL trace of every request's events to this file (default: no trace)"
    )
    log_level: str = _opt("info", "logging level", ("debug", "info", "warning", "error"))
    log_stats_interval: float = _opt(
        10.0, "seconds between the scheduler's stats lines when serving (0: never)"
    )
    max_unread_replies: int = _opt(
        4096,
        "serving: replies (about one per token) a request may hold that its client has not read; past "
        "it the request is aborted with an error event, so a stalled reader cannot grow memory without bound",
    )
    shutdown_timeout: float = _opt(
        5.0, "serving: seconds SIGTERM / Ctrl-C lets open requests finish before ending them with an error"
    )


@dataclass
class ServerConfig:
    """Options of the HTTP front end."""

    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on (0: a free one, printed once serving)")
    served_model_name: str | None = _opt(
        None,
        "model name reported by /v1/models and accepted in `model` fields (default: the model path "
        "or Hugging Face id); one name only",
        nargs="+",
    )
    api_key: str | None = _opt(
        None,
        "require `Authorization: Bearer KEY` on every endpoint but /health and /metrics (default: the "
        "MINFER_API_KEY environment variable; unset: no key)",
    )
    metrics_require_key: bool = _opt(False, "with an API key, require it on /metrics too")
    max_request_bytes: int = _opt(
        4 * 2**20, "largest request body in bytes; a larger one is refused with 413 while it is read"
    )
    max_batch_prompts: int = _opt(128, "most engine requests a body may make (prompts times n); else 400")
    log_requests: bool = _opt(
        False, "log each finished request: id, prompt and completion tokens, finish reason, TTFT, total time"
    )
    metrics_prefix: str = _opt(
        "minfer",
        "names of the /metrics series: minfer's own, or vLLM's (vllm:num_requests_running, ... with a "
        "model_name label) so that dashboards built for vLLM work; docs/TRACE.md",
        ("minfer", "vllm"),
    )
    request_read_timeout: float = _opt(
        30.0, "seconds a client has to send a request's headers and body; then the connection is closed"
    )
    tool_call_parser: str = _opt(
        "auto",
        "how the model writes tool calls: hermes (Qwen2.5/Qwen3 <tool_call> blocks), llama3_json "
        "(Llama 3 JSON); auto: told by the chat template",
        choices=("auto", "hermes", "llama3_json"),
    )
    reasoning_parser: str = _opt(
        "none",
        "chat text before </think> to reasoning_content: qwen3 (answers opening with <think>), deepseek_r1",
        choices=("none", "qwen3", "deepseek_r1"),
    )


def _base_type(tp) -> type:
    """`int | None` -> int; `str` -> str (fields are annotated as strings under __future__)."""
    if isinstance(tp, str):
        tp = eval(tp, {}, {})
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


# vLLM's and SGLang's names for minfer's options: each alias is one more spelling of the
# minfer flag (same type, same check), so a `vllm serve` / `sglang.launch_server` command line
# runs unchanged. docs/SERVING.md "Coming from vLLM / SGLang" renders this table.
FLAG_ALIASES: dict[str, tuple[str, str]] = {
    # alias: (minfer field, note)
    "--model": ("model", "vLLM; same as the positional model argument"),
    "--model-path": ("model", "SGLang; same as the positional model argument"),
    "--tensor-parallel-size": ("tp", "vLLM"),
    "-tp": ("tp", "vLLM"),
    "--tp-size": ("tp", "SGLang"),
    "--gpu-memory-utilization": ("mem_fraction", "vLLM; minfer's fraction also covers the weights"),
    "--mem-fraction-static": ("mem_fraction", "SGLang"),
    "--max-num-seqs": ("max_running_requests", "vLLM"),
    "--max-running-requests": ("max_running_requests", "SGLang; minfer's own name too"),
    "--max-num-batched-tokens": ("chunked_prefill_size", "vLLM; the token budget of one prefill step"),
    "--context-length": ("max_model_len", "SGLang"),
    "--tokenizer-path": ("tokenizer", "SGLang"),
    "--download-dir": ("download_dir", "vLLM; minfer's own name too"),
    "--random-seed": ("seed", "SGLang"),
    "--kv-offloading-size": ("host_kv_cache_gb", "vLLM; GiB of host memory for the offloaded KV cache"),
}


def aliases_of(name: str) -> list[str]:
    """The other spellings of field `name`'s flag."""
    own = "--" + name.replace("_", "-")
    return [alias for alias, (field_name, _) in FLAG_ALIASES.items() if field_name == name and alias != own]


def _with_default(help: str, default) -> str:
    """Help text that names the default, unless it already does (the flags' values live in the
    dataclass, so argparse never sees them and cannot add them itself)."""
    if "default" in help:
        return help
    shown = {False: "off", None: "not set"}.get(default, default) if default in (False, None) else default
    return f"{help} (default: {shown})"


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag` (plus its vLLM/SGLang aliases) per dataclass field of `cls`. Defaults stay
    with the dataclass (SUPPRESS), so only the flags given reach it."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *aliases_of(f.name)]
        tp = _base_type(f.type)
        kwargs = {
            "help": _with_default(f.metadata["help"], f.default),
            "default": argparse.SUPPRESS,
            "dest": f.name,
        }
        if tp is bool:
            parser.add_argument(*flags, action="store_true", **kwargs)
        else:
            nargs = f.metadata.get("nargs")
            parser.add_argument(*flags, type=tp, choices=f.metadata.get("choices"), nargs=nargs, **kwargs)


def config_from_kwargs(cls, kwargs: dict, strict: bool = True):
    """Build `cls` from the subset of `kwargs` it knows; unknown names are an error when strict."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(kwargs) - names
    if strict and unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; valid options are {sorted(names)}")
    cfg = cls(**{k: v for k, v in kwargs.items() if k in names})
    validate_choices(cfg)
    validate_values(cfg)
    return cfg


def validate_choices(cfg) -> None:
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{f.name}={value!r} is not one of {list(choices)}")


# field: (smallest, largest) allowed value; None in a field that allows None means "not set".
_RANGES: dict[str, tuple[float, float]] = {
    "max_model_len": (1, float("inf")),
    "cpu_threads": (1, 4096),
    "page_size": (1, float("inf")),
    "kv_cache_tokens": (1, float("inf")),
    "mem_fraction": (0.01, 1.0),
    "host_kv_cache_gb": (0, float("inf")),
    "max_running_requests": (1, float("inf")),
    "max_queued_requests": (0, float("inf")),
    "chunked_prefill_size": (1, float("inf")),
    "tp": (1, float("inf")),
    "nnodes": (1, float("inf")),
    "node_rank": (0, float("inf")),
    "cuda_graph_max_bs": (0, float("inf")),
    "prefill_cuda_graph_max_tokens": (0, float("inf")),
    "log_stats_interval": (0, float("inf")),
    "max_unread_replies": (1, float("inf")),
    "shutdown_timeout": (0, float("inf")),
    "port": (0, 65535),
    "max_request_bytes": (1, float("inf")),
    "max_batch_prompts": (1, float("inf")),
    "request_read_timeout": (0.001, float("inf")),
}


def validate_values(cfg) -> None:
    """Refuse values no run could use, naming the flag, the value and the limit."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in _RANGES and value is not None:
            low, high = _RANGES[f.name]
            if not low <= value <= high:
                limit = f">= {low:g}" if high == float("inf") else f"in [{low:g}, {high:g}]"
                raise ConfigError(f"--{f.name.replace('_', '-')}={value} must be {limit}")
    if getattr(cfg, "host_kv_cache_gb", 0) and cfg.cache != "radix":  # the tier sits behind it
        raise ConfigError("--host-kv-cache-gb needs --cache radix")
    if getattr(cfg, "host_kv_cache_gb", 0) and cfg.tp > 1:
        # TP ranks must schedule alike, and each would see its own loads finish at its own moment.
        raise ConfigError("--host-kv-cache-gb works with --tp 1 only")
    quantization = getattr(cfg, "quantization", None)
    if quantization not in (None, *QUANTIZATION_METHODS):
        raise ConfigError(
            f"--quantization {quantization}: minfer cannot run quantized weights of that method; "
            f"it runs {list(QUANTIZATION_METHODS)} (a .gguf file's Q4_0/Q4_1 blocks with 'gguf')"
        )
