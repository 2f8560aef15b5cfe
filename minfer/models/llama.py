"""The Llama decoder, which Qwen2, Qwen3 and Mistral share with small variations.

Variations are switches, not subclasses with overridden internals:
  qkv_bias  Qwen2/2.5 add a bias to the Q, K, V projections
  qk_norm   Qwen3 RMS-normalises each query and key head before RoPE
Parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up are fused
(see `STACKED`), which `load_weights` maps back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minfer.attention.base import ForwardContext
from minfer.distributed.parallel import SINGLE, TPGroup
from minfer.kernels.new_kv import NewKV
from minfer.layers.attention import PagedAttention, sliding_window_of
from minfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minfer.layers.norm import RMSNorm
from minfer.layers.rotary import RotaryEmbedding, context_length, rope_parameters

# checkpoint name fragment -> (fused parameter fragment, shard id)
STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg, layer_id: int, tp: TPGroup, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool
    ):
        super().__init__()
        d = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, False, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            d,
        )
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary  # one cos/sin table shared by all layers
        self.layer_id = layer_id
        self.attn = PagedAttention(layer_id, self.num_heads, self.head_dim, sliding_window_of(cfg, layer_id))

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Attention over the output of `qkv_proj`, which the decoder layer runs (with its norm)."""
        q, k, v = self.qkv_proj.split(qkv)
        t = qkv.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        new_kv = None
        if q.is_cuda:  # the same three steps in a Triton kernel (rope_store.py), run by the attention
            norms = (
                (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else ()
            )
            new_kv = NewKV(k, v, positions, self.rotary.cos_sin, ctx.out_loc, *norms)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
            ctx.kv_pool.store(self.layer_id, k, v, ctx.out_loc)  # the write step of the KV life cycle
        return self.o_proj(self.attn(q, ctx, new_kv))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, tp
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.folds_silu(x):
            return self.down_proj(self.gate_up_proj.forward_silu(None, x)[0])
        return self.down_proj.forward_gated(self.gate_up_proj(x))

    def forward_normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor):
        """(self(norm(x + residual)), x + residual), the norm inside gate_up where it folds. The
        SiLU-and-multiply ends the gate_up kernel where it can, else begins the down's."""
        if self.gate_up_proj.folds_silu(x):
            activated, residual = self.gate_up_proj.forward_silu(norm, x, residual)
            return self.down_proj(activated), residual
        gate_up, residual = self.gate_up_proj.forward_normed(norm, x, residual)
        return self.down_proj.forward_gated(gate_up), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg,
        layer_id: int,
        tp: TPGroup,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm: bool,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, tp, rotary, qkv_bias, qk_norm)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, ctx):
        # Each norm is handed to the projection after it, which may run it in its own kernel
        # (ColumnParallelLinear.forward_normed); a mixture-of-experts MLP takes the norm's output.
        qkv, residual = self.self_attn.qkv_proj.forward_normed(self.input_layernorm, x, residual)
        x = self.self_attn(positions, qkv, ctx)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp.forward_normed(self.post_attention_layernorm, x, residual)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, tp: TPGroup, max_positions: int, qkv_bias: bool, qk_norm: bool, make_mlp=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(head_dim_of(cfg), max_positions, rope_parameters(cfg))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, tp, rotary, qkv_bias, qk_norm, make_mlp and make_mlp(cfg, i, tp))
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # --quantization on CPU: the same layers in fewer torch ops (minfer/models/quantized_forward.py)
    lean_forward = None

    def forward(self, input_ids, positions, ctx):
        if self.lean_forward is not None:
            return self.lean_forward(input_ids, positions, ctx)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg, tp: TPGroup = SINGLE, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        max_positions = max_positions or context_length(cfg)
        qkv_bias = self.qkv_bias or bool(getattr(cfg, "attention_bias", False))
        self.model = LlamaModel(cfg, tp, max_positions, qkv_bias, self.qk_norm, self.make_mlp)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # The MLP of layer `layer_id`; None: the dense LlamaMLP. Mixture-of-experts models override it.
    make_mlp = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """(parameter name, shard id or None) that checkpoint tensor `name` loads into."""
        for fragment, (fused, shard_id) in STACKED.items():
            if fragment in name:
                return name.replace(fragment, fused), shard_id
        return name, None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits; into `out` when given (CUDA graphs share one static buffer)."""
        return self.lm_head.compute_logits(hidden, out)

    def shard_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This TP rank's vocabulary slice of the logits (see ParallelLMHead.shard_logits)."""
        return self.lm_head.shard_logits(hidden, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by Hugging Face name, sharding each as it arrives."""
        params = dict(self.named_parameters(remove_duplicate=False))
        seen = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            name, shard = self.checkpoint_target(name)
            if name not in params:
                raise KeyError(
                    f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}"
                )
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            tensor = tensor.to(param.dtype)
            if loader is None:
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            seen.add(name)
        missing = set(params) - seen
        if self.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise KeyError(
                f"checkpoint lacks tensors for: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}"
            )
