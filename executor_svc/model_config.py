"""What the model code needs to know about a checkpoint, read from its transformers config."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# model_type -> (q/k/v projections carry a bias, o projection carries a bias); None: read the config
# (attention_bias or qkv_bias; attention_out_bias, else the same but for QKV_BIAS_ONLY).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool] | None] = {
    "llama": None,  # attention_bias covers q, k, v and o
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": None,
    "smollm3": None,  # Llama with the rotary embedding left out of some layers (no_rope_layers)
    "granite": None,  # Llama with multipliers: embeddings, residual branches, attention scale, logits
    # Gemma 3's text model: norms around each sublayer too, weights used as 1 + w, GELU, a rotary table per
    # layer type (sliding or full attention).
    "gemma3_text": None,
    # Gemma 2: Gemma 3's layers without the q/k norms, one rotary table, and tanh caps on the attention scores
    # and the logits.
    "gemma2": None,
    # Phi-3 and Phi-4-mini: q/k/v and gate/up stored fused, as this model code holds them; a partial rotary
    # embedding (partial_rotary_factor) and LongRoPE (its short factors within the original context by default).
    "phi3": (False, False),
    # Mixtures of experts: each token's MLP is the weighted sum of its top-k experts' (SparseMoE in the model).
    "mixtral": (False, False),
    "qwen2_moe": None,  # Qwen2's attention, and a gated shared expert beside the routed ones
    "qwen3_moe": None,
    "granitemoe": None,  # Granite's multipliers; the router's softmax over each token's top-k logits
    "granitemoeshared": None,  # and an ungated shared MLP
    "olmoe": None,  # q/k RMS-normalised over each token's whole projection, not per head
    # OLMo 2: norms on each sublayer's output only, q/k norms over the whole projection; OLMo 3 adds sliding-window
    # layers with a rotary table per layer type.
    "olmo2": None,
    "olmo3": None,
    "ministral": (False, False),  # Mistral with sliding-window layers by layer_types
    # EXAONE 4: OLMo 2's post norms with per-head q/k norms; with a sliding window, the rotary embedding on the
    # sliding layers alone.
    "exaone4": (False, False),
    "seed_oss": None,  # the o projection's bias apart: attention_out_bias
    "helium": None,  # the rotary embedding turns interleaved pairs (rope_interleaved)
}
# Vision-language checkpoints whose language model is one of the above (text_config): served as that model alone,
# text in and text out, their vision tower and projector left unloaded.
VISION_LANGUAGE_WRAPPERS = frozenset({"gemma3", "mistral3", "llava"})
# Architectures whose attention_bias (or qkv_bias) is on q, k and v alone, not on the o projection.
QKV_BIAS_ONLY = frozenset({"qwen2_moe", "helium"})
# Architectures whose rotary embedding turns interleaved pairs of each head's dimensions.
INTERLEAVED_ROPE = frozenset({"helium"})
# Architectures with a rotary table per layer type (rope_parameters keyed by layer_types' names).
LAYER_TYPE_ROPE = frozenset({"gemma3_text", "olmo3"})
# Architectures whose sliding_window applies only where use_sliding_window is set.
SLIDING_WINDOW_FLAGGED = frozenset({"qwen2", "qwen3", "smollm3", "qwen2_moe", "qwen3_moe"})
# Architectures that RMS-normalise each head of q and k (weights per head dimension) before the rotary embedding.
QK_NORM_ARCHITECTURES = frozenset({"qwen3", "qwen3_moe", "gemma3_text", "olmoe", "olmo2", "olmo3", "exaone4"})
# Of those, the ones whose q and k norms take each token's whole projection (weights per head and dimension).
QK_NORM_OVER_HEADS = frozenset({"olmoe", "olmo2", "olmo3"})
# Architectures with RMSNorms on each sublayer's output only (OLMo 2's placement).
POST_NORM_ARCHITECTURES = frozenset({"olmo2", "olmo3", "exaone4"})
# Architectures whose norms multiply by their weights in float32 and round once (Gemma's, OLMo 2's).
FLOAT32_NORM_PRODUCTS = frozenset({"gemma2", "gemma3_text", "olmo2", "olmo3"})
# Architectures whose attention caps its scores by attn_logit_softcapping (Gemma 3's config has the field too, which
# its attention in transformers never applies).
ATTENTION_SOFTCAP_ARCHITECTURES = frozenset({"gemma2"})

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class MixtureOfExperts:
    """The sparse MLP of a mixture-of-experts model, as transformers routes it: the router's softmax over the
    experts in float32, each token's top-k of it (rescaled to sum to 1 where norm_topk_prob), and the token's
    MLP output the sum of those experts' outputs times their weights."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    # Qwen's routers round the weights to the model's dtype before they scale the experts' outputs; Mixtral's
    # scale them in float32.
    weights_in_model_dtype: bool
    layers: frozenset[int]  # the layers whose MLP is sparse; the others keep a dense one of intermediate_size
    # Granite MoE's routing: the softmax over each token's top-k logits, rather than the top-k of the softmax.
    softmax_over_top_k: bool = False
    shared_expert_intermediate_size: int = 0  # a dense MLP beside the routed experts, on every token; 0: none
    shared_expert_gated: bool = False  # Qwen2-MoE's: its output scaled by a sigmoid gate of the token

    @classmethod
    def from_hf_config(cls, hf_config) -> "MixtureOfExperts | None":
        model_type = hf_config.model_type
        if model_type == "mixtral":
            return cls._checked(cls(
                num_experts=hf_config.num_local_experts, experts_per_token=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.intermediate_size, norm_topk_prob=True, weights_in_model_dtype=False,
                layers=frozenset(range(hf_config.num_hidden_layers))))
        if model_type in ("granitemoe", "granitemoeshared"):
            return cls._checked(cls(
                num_experts=hf_config.num_local_experts, experts_per_token=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.intermediate_size, norm_topk_prob=False, weights_in_model_dtype=True,
                layers=frozenset(range(hf_config.num_hidden_layers)), softmax_over_top_k=True,
                shared_expert_intermediate_size=int(getattr(hf_config, "shared_intermediate_size", 0) or 0)))
        if model_type == "olmoe":
            return cls._checked(cls(
                num_experts=hf_config.num_experts, experts_per_token=hf_config.num_experts_per_tok,
                intermediate_size=hf_config.intermediate_size, norm_topk_prob=bool(hf_config.norm_topk_prob),
                weights_in_model_dtype=True, layers=frozenset(range(hf_config.num_hidden_layers))))
        if model_type not in ("qwen2_moe", "qwen3_moe"):
            return None
        step, dense = hf_config.decoder_sparse_step, set(getattr(hf_config, "mlp_only_layers", None) or ())
        if hf_config.num_experts <= 0 or step < 1:
            raise ValueError(f"{model_type} needs num_experts > 0 and decoder_sparse_step >= 1")
        return cls._checked(cls(
            num_experts=hf_config.num_experts, experts_per_token=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size, norm_topk_prob=bool(hf_config.norm_topk_prob),
            weights_in_model_dtype=True,
            layers=frozenset(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0),
            shared_expert_intermediate_size=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
            shared_expert_gated=True))

    def _checked(self) -> "MixtureOfExperts":
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.experts_per_token}")
        if self.intermediate_size < 1:
            raise ValueError(f"the experts' intermediate size must be positive, got {self.intermediate_size}")
        return self


@dataclass(frozen=True)
class ModelArchitecture:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    hf_config: object  # the transformers config, for the RoPE tables
    attention_scale: float  # the scores' factor: head_dim ** -0.5 but where the config sets its own
    no_rope_layers: frozenset[int] = frozenset()  # layers whose q and k take no rotary embedding
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # on each attention and MLP output before it joins the residual stream
    logits_scaling: float = 1.0  # the logits are divided by it
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or gelu_pytorch_tanh (GELU, tanh approximation)
    # Where the RMSNorms sit: "pre" (Llama: before each sublayer), "sandwich" (Gemma: before each sublayer and on
    # its output before it joins the residual stream) or "post" (OLMo 2: on each sublayer's output only).
    norm_placement: str = "pre"
    gemma_norms: bool = False  # every RMSNorm weight stored as w for a factor of 1 + w (Gemma)
    # The norms' product with the weight in float32, rounded once (Gemma, OLMo 2), rather than the normalised row
    # rounded to the model's dtype first (Llama): a bfloat16 model keeps its norm weights in float32.
    float32_norm_products: bool = False
    # The rotary table of each layer: a key of rope_parameters where the config gives one per layer type, else None.
    layer_rope: tuple[str | None, ...] = ()
    # Each layer's sliding window (a query at position p sees the keys at (p - window, p]), None for full
    # attention; empty where no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    rotary_dim: int = 0  # the leading dims of each head the rotary embedding turns (partial_rotary_factor); 0: all
    # tanh caps (Gemma 2): scores become c * tanh(scores / c) before the mask, and the logits likewise; None: none.
    attention_softcap: float | None = None
    logits_softcap: float | None = None
    vision_language_wrapper: str = ""  # the checkpoint's model_type where it wraps this language model, else ""
    moe: MixtureOfExperts | None = None  # the sparse MLP of a mixture-of-experts model; None: dense
    qk_norm_over_heads: bool = False  # q/k norms over each token's whole projection (OLMoE), not each head
    qkv_clip: float | None = None  # q, k and v clamped to [-clip, clip] after the norms (OLMoE's clip_qkv)
    # The rotary embedding turns the pairs (2i, 2i + 1) of each head (Helium), not (i, i + head_dim / 2): served by
    # loading q and k with each head's dimensions reordered to the latter (scores are unchanged by a reordering
    # both share).
    rope_interleaved: bool = False
    rope_long_factors: bool = False  # LongRoPE's long factors at every position (a context past the original)

    @classmethod
    def from_hf_config(cls, hf_config, max_model_len: int | None = None) -> "ModelArchitecture":
        model_type = hf_config.model_type
        if model_type in VISION_LANGUAGE_WRAPPERS:
            language_model = cls.from_hf_config(hf_config.text_config, max_model_len)
            # The wrapper's own settings rule where it has them, as in transformers: whether the head is tied
            # to the embeddings, and the EOS ids (some wrappers alone carry them).
            return dataclasses.replace(
                language_model, vision_language_wrapper=model_type,
                tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", language_model.tie_word_embeddings)),
                eos_token_ids=language_model.eos_token_ids or _eos_ids(getattr(hf_config, "eos_token_id", None)),
            )
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {model_type!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}, and text "
                f"only, the language models of {sorted(VISION_LANGUAGE_WRAPPERS)}"
            )
        biases = SUPPORTED_ARCHITECTURES[model_type]
        gemma = model_type in ("gemma3_text", "gemma2")
        if biases is None:
            qkv_bias = getattr(hf_config, "qkv_bias", None)  # Qwen2-MoE's name for it
            qkv_bias = bool(getattr(hf_config, "attention_bias", False) if qkv_bias is None else qkv_bias)
            o_bias = getattr(hf_config, "attention_out_bias", None)  # Seed-OSS sets it apart
            biases = (qkv_bias, bool(qkv_bias and model_type not in QKV_BIAS_ONLY if o_bias is None else o_bias))
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(f"{model_type} with bidirectional attention (an embedding model) is not supported")
        context_len = hf_config.max_position_embeddings
        rope = getattr(hf_config, "rope_parameters", None) or {}
        rope_long_factors = False
        if max_model_len is not None and not 0 < max_model_len <= context_len:
            raise ValueError(f"max_model_len must be in [1, {context_len}], got {max_model_len}")
        if rope.get("rope_type") == "longrope":
            # transformers turns a whole sequence to the long factors once it passes the original context (the
            # cached keys keep the short ones), which a batch of requests at other lengths cannot reproduce. By
            # default the short factors, exact within the original context, are served up to it; a longer
            # max_model_len takes the long factors for every position, as vLLM does (exact for sequences past
            # the original context, not within it).
            original = rope.get("original_max_position_embeddings") or context_len
            if max_model_len is None and original < context_len:
                context_len = original
                logger.info("%s: LongRoPE served within its original context of %d tokens (a longer "
                            "--max-model-len takes its long factors)", model_type, original)
            rope_long_factors = max_model_len is not None and max_model_len > original
            if rope_long_factors:
                logger.warning("%s: LongRoPE's long factors at every position, for a context of %d tokens past "
                               "the original %d: within the original context outputs differ from transformers' "
                               "(short factors there)", model_type, max_model_len, original)
        if max_model_len is None:
            max_model_len = context_len
        if model_type in INTERLEAVED_ROPE and model_type in QK_NORM_ARCHITECTURES:
            raise ValueError(f"{model_type}: q/k norms with an interleaved rotary embedding are not supported")
        partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)) or 1.0
        rotary_dim = int(head_dim * partial)
        if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of head_dim {head_dim}")
        # The scores' factor: Granite's multiplier, Gemma's query_pre_attn_scalar ** -0.5, else head_dim ** -0.5.
        attention_scale = getattr(hf_config, "attention_multiplier", None)
        if attention_scale is None:
            attention_scale = (getattr(hf_config, "query_pre_attn_scalar", None) or head_dim) ** -0.5
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            qkv_bias=biases[0],
            o_bias=biases[1],
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type in QK_NORM_ARCHITECTURES,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_model_len=max_model_len,
            eos_token_ids=_eos_ids(hf_config.eos_token_id),
            hf_config=hf_config,
            attention_scale=float(attention_scale),
            no_rope_layers=_no_rope_layers(hf_config),
            embedding_multiplier=hf_config.hidden_size**0.5 if gemma else float(getattr(hf_config,
                                                                                       "embedding_multiplier", 1.0)),
            residual_multiplier=float(getattr(hf_config, "residual_multiplier", 1.0)),
            logits_scaling=float(getattr(hf_config, "logits_scaling", 1.0)),
            hidden_act=getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu"),
            norm_placement="sandwich" if gemma else "post" if model_type in POST_NORM_ARCHITECTURES else "pre",
            gemma_norms=gemma,
            float32_norm_products=model_type in FLOAT32_NORM_PRODUCTS,
            layer_rope=tuple(getattr(hf_config, "layer_types", None) or ()) if model_type in LAYER_TYPE_ROPE else (),
            layer_windows=_layer_windows(hf_config),
            rotary_dim=rotary_dim,
            attention_softcap=(_positive(hf_config, "attn_logit_softcapping")
                               if model_type in ATTENTION_SOFTCAP_ARCHITECTURES else None),
            logits_softcap=_positive(hf_config, "final_logit_softcapping"),
            moe=MixtureOfExperts.from_hf_config(hf_config),
            qk_norm_over_heads=model_type in QK_NORM_OVER_HEADS,
            qkv_clip=_positive(hf_config, "clip_qkv"),
            rope_interleaved=model_type in INTERLEAVED_ROPE,
            rope_long_factors=rope_long_factors,
        )

    def rope_inv_freq(self, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and the cos/sin scale, computed the way transformers computes them; layer_type:
        which of a config's per-layer-type tables (layer_rope)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = getattr(self.hf_config, "rope_parameters", None) or {}
        if layer_type is not None:
            rope = rope[layer_type]
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            theta = rope.get("rope_theta", 10000.0)
            dim = self.rotary_dim or self.head_dim
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            return 1.0 / (theta ** exponents), 1.0
        if rope_type == "dynamic":
            # Dynamic NTK rescales with the running sequence length, which a shared flat batch lacks.
            raise ValueError("rope_type 'dynamic' is not supported; use 'linear', 'yarn' or 'llama3'")
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        if self.rope_long_factors:
            kwargs["seq_len"] = self.max_model_len  # past the original context: the long factors
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, "cpu", **kwargs)
        return inv_freq.float(), float(scale)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def _eos_ids(eos) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))


def _no_rope_layers(hf_config) -> frozenset[int]:
    """The layers whose q and k take no rotary embedding: SmolLM3's no_rope_layers holds 1 for each layer that does
    use it; EXAONE 4 with a sliding window turns only its sliding layers."""
    if hf_config.model_type == "exaone4":
        if getattr(hf_config, "sliding_window", None) is None:
            return frozenset()
        return frozenset(i for i, kind in enumerate(hf_config.layer_types) if kind != "sliding_attention")
    return frozenset(i for i, rope in enumerate(getattr(hf_config, "no_rope_layers", None) or []) if not rope)


def _positive(hf_config, name: str) -> float | None:
    cap = getattr(hf_config, name, None)
    if cap is not None and not cap > 0:
        raise ValueError(f"{name} must be positive, got {cap}")
    return None if cap is None else float(cap)


def _layer_windows(hf_config) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: the layers that layer_types marks
    "sliding_attention", or every layer where the config has a window but no layer types (Mistral)."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return ()
    if hf_config.model_type in SLIDING_WINDOW_FLAGGED and not getattr(hf_config, "use_sliding_window", False):
        return ()
    if int(window) < 1:
        raise ValueError(f"sliding_window must be at least 1, got {window}")
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (int(window),) * hf_config.num_hidden_layers
    if len(layer_types) != hf_config.num_hidden_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers, the model has {hf_config.num_hidden_layers}")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}; sliding_attention or full_attention")
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()
