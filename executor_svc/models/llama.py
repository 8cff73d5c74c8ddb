"""Llama-family decoder (Llama, Mistral, Ministral, Qwen2, Qwen3, SmolLM2, SmolLM3, Granite, Gemma 2 and 3, Phi-3,
OLMo 2 and 3, EXAONE 4, Seed-OSS, Helium, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE
and OLMoE) over a flat batch of tokens.

Every token of a step, from every request, prefill chunks and decodes alike, is one row of a
``[num_tokens, hidden]`` tensor with its own position; attention is the only place requests are told
apart, through the attention metadata. q/k/v and gate/up projections are fused into one matmul each.
The arithmetic follows transformers' LlamaModel step for step (norms in float32, RoPE tables in float32
cast to the model dtype) so that float32 logits agree to rounding. Given the CPU extension's fused ops
(executor_svc/csrc), a float32 or bfloat16 model runs each RMSNorm and each layer's rotary embedding as one of
them rather than as several small torch operators, the same arithmetic in the same order, rounded where
torch's operators round; its MLP's SiLU-and-mul too, in place over the gate half (the exp is the kernels' own),
and its float32 linear layers' products of few rows (decodes) as the extension's split_linear: the same products
(bit for bit on SmolLM2's shapes), the output features split across the threads rather than by MKL. A bfloat16
model's linear layers run on weights packed once for oneDNN (pack_bfloat16_linears), F.linear's products without
the reorder F.linear does on every call.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model_config import ModelArchitecture

# The dtypes the CPU extension's RMSNorm and rotary read and write.
FUSED_DTYPES = (torch.float32, torch.bfloat16)
# The name of the rotary table of a model with one.
ALL_LAYERS = "all"
# Products of more rows than this keep MKL's own threading, as fast there (executor_svc/csrc/linear_cpu.cpp).
SPLIT_LINEAR_MAX_ROWS = 512


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fused_ops,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x weight^T (+ bias): through the weight's oneDNN-packed copy where it has one (pack_bfloat16_linears),
    else the extension's split product for few rows, else torch's."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if fused_ops is not None and x.dtype in FUSED_DTYPES and x.dim() == 2 and x.shape[0] <= SPLIT_LINEAR_MAX_ROWS:
        return fused_ops.split_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def pack_for_onednn(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """weight [N, K] in oneDNN's blocked layout, if its product there is bit for bit F.linear's (checked on a few
    rows); None where torch has no oneDNN or the products differ.

    F.linear on a plain bfloat16 weight has oneDNN reorder it on every call: a product of few rows (decodes) then
    read the weights at 11-15 GB/s of the ~33 a Zen 4 EPYC streams. Packed once, the same oneDNN products ran
    1.4x faster at 1 row, 1.7x at 4 and 1.2x at 64 (SmolLM2's projections, two threads), and equal to F.linear's
    at every row count, so outputs do not change. (float32 goes to MKL in F.linear and to oneDNN packed, which
    round differently: it stays plain.)"""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        same = torch.equal(linear(probe, weight, bias, None, packed), F.linear(probe, weight, bias))
    except (RuntimeError, AttributeError):  # no such op in this build of torch
        return None
    return packed if same else None


class Linear(nn.Linear):
    """nn.Linear (its weights load as one's) through linear() above."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fused_ops=None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fused_ops = fused_ops
        self.packed: torch.Tensor | None = None  # the weight packed for oneDNN, which then replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fused_ops, self.packed)

    @property
    def reads_strided_rows(self) -> bool:
        """Whether a product over strided rows reads them in place (oneDNN's packed one copies them first)."""
        return self.packed is None

    def pack(self) -> bool:
        """Moves the weight into oneDNN's layout where pack_for_onednn can (the plain copy is let go)."""
        self.packed = pack_for_onednn(self.weight, self.bias)
        if self.packed is not None:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return self.packed is not None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, fused_ops=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused_ops = fused_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(residual + x), residual + x), the sum written into residual on the
        fused path: the skip connection and the next norm in one pass."""
        fused = self.fused_ops is not None and x.dtype in FUSED_DTYPES
        if residual is not None:
            if fused:
                out = torch.empty_like(x)
                self.fused_ops.add_rms_norm(out, residual, x, self.weight, self.eps)
                return out, residual
            residual = residual + x
            return self.forward(residual), residual
        if fused:
            out = torch.empty_like(x)
            self.fused_ops.rms_norm(out, x, self.weight, self.eps)
            return out
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype != dtype:  # a float32 factor (Gemma's 1 + w) multiplies before the one rounding
            return (x32 * self.weight).to(dtype)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelArchitecture, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scale = config.rope_inv_freq(layer_type)
        positions = torch.arange(config.max_model_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x's leading cos.shape[-1] dims; the others pass through (a partial embedding)."""
    dims = cos.shape[-1]
    if dims < x.shape[-1]:
        return torch.cat((_apply_rotary(x[..., :dims], cos, sin), x[..., dims:]), dim=-1)
    half = dims // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelArchitecture, attention_backend, fused_ops=None, rotary: bool = True,
                 window: int | None = None) -> None:
        super().__init__()
        self.fused_ops = fused_ops
        self.rotary = rotary
        self.window = window  # sliding window, or None for full attention
        self.softcap = config.attention_softcap
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, fused_ops)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, fused_ops)
        # Per head (weights per head dimension), or over each token's whole projection (OLMoE).
        self.qk_norm_over_heads = config.qk_norm_over_heads
        q_norm_size, k_norm_size = (self.q_size, self.kv_size) if self.qk_norm_over_heads else (self.head_dim,) * 2
        self.q_norm = RMSNorm(q_norm_size, config.rms_norm_eps, fused_ops) if config.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, config.rms_norm_eps, fused_ops) if config.qk_norm else None
        self.qkv_clip = config.qkv_clip
        self.backend = attention_backend

    def forward(self, hidden, cos, sin, kv_cache, meta) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.qk_norm_over_heads:
            q.copy_(self.q_norm(q))  # in place in the projection's output, as below
            k.copy_(self.k_norm(k))
        elif self.q_norm is not None:
            # Per head, in place in the projection's output (its rows are strided: the norm runs on a dense copy).
            q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, -1))
            k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, -1))
        if self.qkv_clip is not None:
            for t in (q, k, v):
                t.clamp_(-self.qkv_clip, self.qkv_clip)
        if self.rotary and self.fused_ops is not None and q.dtype in FUSED_DTYPES:
            self.fused_ops.rotary(q, k, cos, sin, self.head_dim)  # in place, in the projection's output
        elif self.rotary:
            q = _apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin).reshape(num_tokens, -1)
            k = _apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin).reshape(num_tokens, -1)
        key_cache, value_cache = kv_cache
        if key_cache.dtype != q.dtype:  # a K/V dtype of its own (kv_cache_dtype): attention runs in it
            cast = key_cache.dtype
            out = self.backend.forward(q.to(cast), k.to(cast), v.to(cast), key_cache, value_cache, meta, self.window,
                                       self.softcap).to(q.dtype)
        else:
            out = self.backend.forward(q, k, v, key_cache, value_cache, meta, self.window, self.softcap)
        return self.o_proj(out)


def gated_activation(gate_up: torch.Tensor, intermediate_size: int, gelu: bool, fused_ops,
                     in_place: bool) -> torch.Tensor:
    """act(gate) * up of gate_up [T, 2I] = (gate, up): SiLU or GELU (tanh approximation)."""
    if gelu:
        gate, up = gate_up.split(intermediate_size, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if fused_ops is not None and gate_up.dtype in FUSED_DTYPES:
        # In place, the result goes over the gate half (each element read before it is written): no new [T, I]
        # tensor to fault in, and its lines are the ones just read. A product that would copy strided rows
        # (in_place False) gets a dense tensor instead.
        activated = (gate_up[:, :intermediate_size] if in_place
                     else gate_up.new_empty(gate_up.shape[0], intermediate_size))
        fused_ops.silu_mul(activated, gate_up)
        return activated
    gate, up = gate_up.split(intermediate_size, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, config: ModelArchitecture, fused_ops=None, intermediate_size: int | None = None) -> None:
        """intermediate_size: where it is not the config's (a mixture of experts' shared expert)."""
        super().__init__()
        self.fused_ops = fused_ops
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gelu = _gelu(config)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, config.mlp_bias, fused_ops)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, config.mlp_bias, fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = gated_activation(self.gate_up_proj(x), self.intermediate_size, self.gelu, self.fused_ops,
                                     in_place=self.down_proj.reads_strided_rows)
        return self.down_proj(activated)


def _gelu(config: ModelArchitecture) -> bool:
    if config.hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"activation {config.hidden_act!r} is not supported; silu or gelu_pytorch_tanh")
    return config.hidden_act == "gelu_pytorch_tanh"


class SparseMoE(nn.Module):
    """A mixture of experts' MLP (MixtureOfExperts): the router's top-k experts of each token, each expert's
    gated MLP over the rows routed to it, their outputs scaled by the routing weights and summed per token in
    ascending expert order, as transformers sums them; plus a shared expert on every token (Qwen2-MoE's under a
    sigmoid gate). The experts' weights are held stacked, [E, 2I, H] and [E, H, I], as transformers holds them."""

    def __init__(self, config: ModelArchitecture, fused_ops=None) -> None:
        super().__init__()
        moe = config.moe
        self.moe, self.fused_ops, self.gelu = moe, fused_ops, _gelu(config)
        hidden, inter = config.hidden_size, moe.intermediate_size
        self.gate = Linear(hidden, moe.num_experts, False, fused_ops)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(moe.num_experts, hidden, inter))
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = MLP(config, fused_ops, shared) if shared else None
        self.shared_expert_gate = Linear(hidden, 1, False, fused_ops) if shared and moe.shared_expert_gated else None
        # Each expert's (gate/up, down) weights packed for oneDNN (pack), which then replace the stacked ones.
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, *self._weights(index, 0))
        # oneDNN's packed product copies strided rows first: a dense activation is then no dearer.
        activated = gated_activation(gate_up, self.moe.intermediate_size, self.gelu, self.fused_ops,
                                     in_place=self.packed is None)
        return linear(activated, *self._weights(index, 1))

    def _weights(self, index: int, which: int) -> tuple:
        """linear()'s weight, bias, ops and packed weight for expert index's gate/up (0) or down (1) product."""
        if self.packed is not None:
            return None, None, None, self.packed[index][which]
        return (self.experts_gate_up, self.experts_down)[which][index], None, self.fused_ops

    def pack(self) -> bool:
        """Packs every expert's bfloat16 weights for oneDNN (pack_for_onednn), all or none; the stacked weights
        are let go once they are."""
        packed = [(pack_for_onednn(self.experts_gate_up[e], None), pack_for_onednn(self.experts_down[e], None))
                  for e in range(self.moe.num_experts)]
        if any(w is None for pair in packed for w in pair):
            return False
        self.packed = packed
        self.experts_gate_up = nn.Parameter(self.experts_gate_up.new_empty(0), requires_grad=False)
        self.experts_down = nn.Parameter(self.experts_down.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        shared = self.shared_expert(x) if self.shared_expert is not None else None
        if moe.softmax_over_top_k:
            top_logits, experts = torch.topk(self.gate(x).float(), moe.experts_per_token, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        else:
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
            weights, experts = torch.topk(probs, moe.experts_per_token, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        # The (token, choice) pairs grouped by expert: one sort and one count, which the loop then walks.
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=moe.num_experts).tolist()
        rows, pair_weights = order // moe.experts_per_token, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for index, count in enumerate(counts):
            if count:
                routed = rows[start : start + count]
                scaled = self.expert(index, x[routed]) * pair_weights[start : start + count, None]
                out.index_add_(0, routed, scaled.to(out.dtype))
                start += count
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        elif shared is not None:
            out = out + shared
        return out

    def expert_products(self, x: torch.Tensor) -> None:
        """Every expert's two products over x, as if each got x's rows: the linear layers' part of the routed
        experts for the cost probes (executor_svc/costs.py)."""
        for index in range(self.moe.num_experts):
            gate_up = linear(x, *self._weights(index, 0))
            linear(gate_up[:, : self.moe.intermediate_size], *self._weights(index, 1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchitecture, attention_backend, fused_ops=None, index: int = 0) -> None:
        super().__init__()
        self.norm_placement = config.norm_placement
        if self.norm_placement != "post":
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        self.self_attn = Attention(config, attention_backend, fused_ops, rotary=index not in config.no_rope_layers,
                                   window=config.layer_windows[index] if config.layer_windows else None)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        self.mlp = SparseMoE(config, fused_ops) if config.moe and index in config.moe.layers else MLP(config, fused_ops)
        self.residual_multiplier = config.residual_multiplier
        # Gemma's sandwich: post_attention_layernorm normalises the attention's output, pre_feedforward_layernorm
        # is the norm before the MLP (Llama's post_attention_layernorm), post_feedforward_layernorm the MLP's output.
        # OLMo 2's post norms: post_attention_layernorm and post_feedforward_layernorm alone.
        if self.norm_placement == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        if self.norm_placement != "pre":
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        self.rope = config.layer_rope[index] if config.layer_rope else None  # its rotary table

    def forward(self, hidden, residual, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next norm adds the two. residual is
        None for the first layer, whose input is the stream itself."""
        if self.norm_placement == "post":  # the sublayers read the stream itself, summed here
            stream = hidden if residual is None else hidden + residual
            stream = stream + self.post_attention_layernorm(self.self_attn(stream, cos, sin, kv_cache, meta))
            return self.post_feedforward_layernorm(self.mlp(stream)), stream
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn(normed, cos, sin, kv_cache, meta)
        if self.norm_placement == "sandwich":
            normed, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attended), residual)
            return self.post_feedforward_layernorm(self.mlp(normed)), residual
        if self.residual_multiplier != 1.0:
            attended.mul_(self.residual_multiplier)
        normed, residual = self.post_attention_layernorm(attended, residual)
        out = self.mlp(normed)
        if self.residual_multiplier != 1.0:
            out.mul_(self.residual_multiplier)
        return out, residual


# A vision-language checkpoint's language-model weights under their names as a causal LM: the hub's layout first,
# then the one transformers' own modules use.
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                           ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


# One expert's matrix as checkpoints store it: Mixtral's w1/w3/w2 (gate, up, down), Qwen-MoE's by name.
EXPERT_WEIGHT = re.compile(r"(layers\.\d+\.mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
# Qwen2-MoE's shared expert and its gate, which transformers saves (the expert as empty tensors) when the config
# sizes the expert 0.
_EMPTY_SHARED_EXPERT = re.compile(r"\.mlp\.shared_expert(_gate)?\.")
# Mixture-of-experts tensors that load whole -> ours: the stacked experts as transformers names them (its
# state_dict), and Granite MoE checkpoints' stacked experts, router and shared MLP (gate and up stored fused).
WHOLE_MOE_WEIGHTS = {
    ".mlp.experts.gate_up_proj": ".mlp.experts_gate_up", ".mlp.experts.down_proj": ".mlp.experts_down",
    ".mlp.input_linear.weight": ".mlp.experts_gate_up", ".mlp.output_linear.weight": ".mlp.experts_down",
    ".mlp.router.layer.weight": ".mlp.gate.weight",
    ".shared_mlp.input_linear.weight": ".mlp.shared_expert.gate_up_proj.weight",
    ".shared_mlp.output_linear.weight": ".mlp.shared_expert.down_proj.weight",
}


def _language_model_weight(name: str) -> str | None:
    for prefix, replacement in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return None


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelArchitecture, attention_backend, fused_ops=None) -> None:
        """fused_ops: the CPU extension's ops (torch.ops.pagedserve_cpu) for the elementwise steps, or None."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, attention_backend, fused_ops, index)
                                    for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        # One rotary table, or one per layer type (Gemma 3: sliding and full attention).
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(config, kind) for kind in set(config.layer_rope)}
                                    if config.layer_rope else {ALL_LAYERS: RotaryEmbedding(config)})
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, False, fused_ops
        )
        self.fused_ops = fused_ops
        self.packed_head: torch.Tensor | None = None  # a tied head's weight packed for oneDNN
        self.embedding_scale = config.embedding_multiplier  # as embed() applies it (convert() rounds Gemma's)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta,  # the attention backend's metadata for this step
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        tables = {kind: rotary(positions, hidden.dtype) for kind, rotary in self.rotary.items()}
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, *tables[layer.rope or ALL_LAYERS], kv_cache, meta)
        return self.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, scaled by the embedding multiplier (embedding_scale)."""
        hidden = self.embed_tokens(input_ids)
        return hidden if self.embedding_scale == 1.0 else hidden * self.embedding_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = linear(hidden, self.embed_tokens.weight, None, self.fused_ops, self.packed_head)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        logits = logits.float()
        if self.config.logits_softcap is not None:
            cap = self.config.logits_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def convert(self, dtype: torch.dtype) -> None:
        """The weights to dtype but for what transformers applies in float32: the RoPE tables, and the norm weights
        of models whose norms multiply by them in float32 (Gemma's factors 1 + w, which rounded to dtype would
        round twice; OLMo 2's), and Gemma's embedding scale rounded to dtype."""
        kept = {module: module.weight.detach().clone() for module in self.modules()
                if isinstance(module, RMSNorm) and self.config.float32_norm_products}
        self.to(dtype)
        self.rotary.float()
        for module, weight in kept.items():
            module.weight = nn.Parameter(weight)
        # Gemma's sqrt(hidden) rounded to dtype, as transformers rounds it (in bfloat16, gemma-3-1b's 33.94 is
        # 34.0); Granite's multiplier applies as it is.
        if self.config.gemma_norms:
            self.embedding_scale = torch.tensor(self.config.embedding_multiplier, dtype=dtype).item()

    def weight_numel(self) -> int:
        """Weights held: the parameters, a packed layer's as the plain weight it replaced (a tied head's packed copy
        is the embedding table's, counted once)."""
        config = self.config
        experts = 3 * config.moe.num_experts * config.moe.intermediate_size * config.hidden_size if config.moe else 0
        return sum(p.numel() for p in self.parameters()) + sum(
            m.in_features * m.out_features for m in self.modules() if isinstance(m, Linear) and m.packed is not None
        ) + sum(experts for m in self.modules() if isinstance(m, SparseMoE) and m.packed is not None)

    @torch.no_grad()
    def pack_bfloat16_linears(self) -> tuple[int, int]:
        """Packs the linear layers' bfloat16 weights for oneDNN (pack_for_onednn), a mixture of experts' experts
        too, a tied LM head's as a copy beside the embedding table that the lookup reads. Returns (layers packed,
        layers that kept a plain weight), a mixture's experts counted as one layer."""
        layers = [m for m in self.modules() if isinstance(m, (Linear, SparseMoE))]
        packed, total = sum(m.pack() for m in layers), len(layers)
        if self.lm_head is None:
            self.packed_head = pack_for_onednn(self.embed_tokens.weight, None)
            packed, total = packed + (self.packed_head is not None), total + 1
        return packed, total - packed

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in, fusing q/k/v and gate/up, and stacking experts, as they arrive."""
        params, fused = dict(self.named_parameters()), self._fused()
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.config.vision_language_wrapper:
                name = _language_model_weight(name)
                if name is None:
                    continue  # the vision tower or the projector: text-only serving leaves them out
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            if _EMPTY_SHARED_EXPERT.search(name) and self.config.moe and not self.config.moe.shared_expert_intermediate_size:
                if tensor.numel() and "shared_expert_gate" not in name:
                    raise ValueError(f"weight {name!r} of a shared expert that the config sizes 0")
                continue  # a shared expert of size 0 adds nothing; its gate scales that nothing
            target, expert, rows = self._destination(name.removeprefix("model."), fused)
            if target not in params or expert is not None and expert >= params[target].shape[0]:
                raise ValueError(f"unexpected weight {name!r} for a {self.config.model_type} model")
            destination, key = params[target], target
            if expert is not None:
                destination, key = destination[expert], f"{key}[{expert}]"
            if rows is not None:
                destination, key = destination[rows[0] : rows[0] + rows[1]], f"{key}[{rows[0]}]"
            if destination.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}")
            if self.config.rope_interleaved and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
                tensor = self._pairs_half_apart(tensor)
            destination.copy_(tensor)
            if self.config.gemma_norms and target.endswith("norm.weight"):
                destination.add_(1.0)  # Gemma's RMSNorm scales by 1 + w: held as that factor
            loaded.add(key)
        missing = [key for target in params if target not in loaded  # whole, fused in the checkpoint already
                   for key in sorted(self._parts(target, fused) - loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _pairs_half_apart(self, tensor: torch.Tensor) -> torch.Tensor:
        """q or k projection rows (weight or bias) with each head's dimensions 0, 2, 4, ..., 1, 3, 5, ...: the
        interleaved rotary pairs (2i, 2i + 1) become the pairs (i, i + head_dim / 2) the model turns."""
        head_dim = self.config.head_dim
        order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
        return tensor.reshape(-1, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)

    def _fused(self) -> dict[str, tuple[str, int, int]]:
        """transformers name part -> (our fused tensor's name part, row offset, row count)."""
        config = self.config
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        inter, shared = config.intermediate_size, config.moe.shared_expert_intermediate_size if config.moe else 0
        return {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
            "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0, shared),
            "shared_expert.up_proj": ("shared_expert.gate_up_proj", shared, shared),
        }

    def _destination(self, target: str, fused: dict) -> tuple[str, int | None, tuple[int, int] | None]:
        """Where a checkpoint tensor goes: (our parameter, its expert or None, its rows (offset, count) or None)."""
        target = target.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for its sparse MLP
        expert = EXPERT_WEIGHT.fullmatch(target)
        if expert:
            layer, index, kind = expert.groups()
            inter = self.config.moe.intermediate_size if self.config.moe else 0
            if kind in ("w2", "down_proj"):
                return f"{layer}.experts_down", int(index), None
            return f"{layer}.experts_gate_up", int(index), (0, inter) if kind in ("w1", "gate_proj") else (inter, inter)
        for theirs, ours in WHOLE_MOE_WEIGHTS.items():
            if target.endswith(theirs):
                return target.removesuffix(theirs) + ours, None, None
        for part, (ours, offset, count) in fused.items():
            if f".{part}." in target:
                return target.replace(part, ours), None, (offset, count)
        return target, None, None

    def _parts(self, target: str, fused: dict) -> set[str]:
        """The load keys that together fill our parameter target (load_weights)."""
        moe = self.config.moe
        if target.endswith(".experts_gate_up"):
            return {f"{target}[{e}][{offset}]" for e in range(moe.num_experts) for offset in (0, moe.intermediate_size)}
        if target.endswith(".experts_down"):
            return {f"{target}[{e}]" for e in range(moe.num_experts)}
        slices = {f"{target}[{offset}]" for ours, offset, _ in fused.values() if f".{ours}." in f".{target}"}
        return slices or {target}
