"""ModelConfig: the shape and routing of an MoE decoder-only transformer."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeVar

ScoreFunc = Literal["softmax", "sigmoid"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the target model (and its MTP heads).

  Layer `i` is dense when `i < first_k_dense`, MoE otherwise. Routed experts are
  SwiGLU FFNs of width `expert_hidden`; the `n_shared_experts` shared experts are
  fused into one SwiGLU of width `n_shared_experts * expert_hidden`.
  """

  vocab_size: int = 264
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 64
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  max_seq_len: int = 512
  # MoE.
  n_routed_experts: int = 32
  top_k: int = 4
  n_shared_experts: int = 1
  expert_hidden: int = 128
  dense_hidden: int = 768
  first_k_dense: int = 1
  score_func: ScoreFunc = "softmax"
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  n_groups: int = 1
  topk_groups: int = 1
  use_score_bias: bool = False
  # Drafting and output.
  num_mtp_modules: int = 0
  # DeepSeek-V3 MTP layers: their own RMSNorm before the output head (shared_head.norm) instead
  # of the target's final norm, and (when the checkpoint's differs from lm_head) their own head.
  mtp_head_norm: bool = False
  mtp_own_head: bool = False
  # The MTP modules' FFN: 0, as the target's layers (MoE where the target has MoE layers); > 0, a
  # dense SwiGLU of this width, whose draft steps read no routed expert.
  mtp_dense_hidden: int = 0
  tie_embeddings: bool = False
  # Special tokens of the tokenizer the model was trained with.
  eos_id: int = 256
  bos_id: int = 257
  tokenizer: str = "byte"
  # Numerics and the expert-FFN implementation used at inference.
  dtype: str = "float32"
  expert_method: str = "auto"
  # Variants of the imported Hugging Face families (the defaults keep the plain model).
  # Attention: "gqa" (grouped-query) or "mla" (DeepSeek multi-head latent attention).
  attention_type: str = "gqa"
  qkv_bias: bool = False  # Qwen2-MoE: biases on the q/k/v projections.
  # RMSNorm on queries and keys before RoPE: "none", "head" (per head, Qwen3-MoE) or "full"
  # (over all heads of the projection, OLMoE).
  qk_norm: str = "none"
  # MLA (attention_type == "mla"): q_lora_rank 0 projects queries directly (DeepSeek-V2-Lite).
  q_lora_rank: int = 0
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # RoPE scaling: "none" or "yarn" (DeepSeek; MLA only).
  rope_scaling: str = "none"
  rope_factor: float = 1.0
  rope_original_max_len: int = 0
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_mscale: float = 1.0
  rope_mscale_all_dim: float = 0.0
  # Shared experts: width (0 means n_shared_experts * expert_hidden) and Qwen2-MoE's sigmoid gate.
  shared_expert_hidden: int = 0
  shared_expert_gate: bool = False

  def __post_init__(self) -> None:
    def need(cond: bool, msg: str):
      if not cond:
        raise ValueError(f"ModelConfig: {msg}")

    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len"):
      need(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
    need(
      self.n_heads % self.n_kv_heads == 0,
      f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})",
    )
    need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
    need(0 <= self.first_k_dense <= self.n_layers, f"first_k_dense must be in [0, n_layers], got {self.first_k_dense}")
    if self.n_moe_layers:
      need(self.n_routed_experts > 0, "n_routed_experts must be > 0")
      need(
        1 <= self.top_k <= self.n_routed_experts,
        f"top_k must be in [1, n_routed_experts={self.n_routed_experts}], got {self.top_k}",
      )
      need(self.expert_hidden > 0, "expert_hidden must be > 0")
      need(self.n_shared_experts >= 0, "n_shared_experts must be >= 0")
      need(
        self.score_func in ("softmax", "sigmoid"), f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}"
      )
      need(
        self.n_groups >= 1 and self.n_routed_experts % self.n_groups == 0,
        f"n_groups ({self.n_groups}) must divide n_routed_experts ({self.n_routed_experts})",
      )
      need(1 <= self.topk_groups <= self.n_groups, f"topk_groups must be in [1, n_groups], got {self.topk_groups}")
      need(
        self.top_k <= self.topk_groups * self.n_routed_experts // self.n_groups,
        "top_k exceeds the experts available in topk_groups groups",
      )
    if self.first_k_dense:
      need(self.dense_hidden > 0, "dense_hidden must be > 0 when first_k_dense > 0")
    need(self.num_mtp_modules >= 0, "num_mtp_modules must be >= 0")
    need(self.mtp_dense_hidden >= 0, f"mtp_dense_hidden must be >= 0, got {self.mtp_dense_hidden}")
    need(self.dtype in ("float32", "bfloat16"), f"dtype must be float32 or bfloat16, got {self.dtype!r}")
    need(
      self.expert_method in ("auto", "xla", "dedup", "per_slot"),
      f"expert_method must be auto, xla, dedup or per_slot, got {self.expert_method!r}",
    )
    need(0 <= self.eos_id < self.vocab_size, f"eos_id {self.eos_id} outside the vocabulary")
    need(self.attention_type in ("gqa", "mla"), f"attention_type must be 'gqa' or 'mla', got {self.attention_type!r}")
    need(self.qk_norm in ("none", "head", "full"), f"qk_norm must be 'none', 'head' or 'full', got {self.qk_norm!r}")
    if self.attention_type == "mla":
      need(self.kv_lora_rank > 0, "kv_lora_rank must be > 0 for MLA")
      need(
        self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
        f"qk_rope_head_dim must be even and > 0 for MLA, got {self.qk_rope_head_dim}",
      )
      need(
        self.qk_nope_head_dim >= 0 and self.v_head_dim > 0 and self.q_lora_rank >= 0,
        "MLA needs qk_nope_head_dim >= 0, v_head_dim > 0 and q_lora_rank >= 0",
      )
      need(self.qk_norm == "none" and not self.qkv_bias, "MLA takes no qk_norm and no qkv_bias")
    need(self.rope_scaling in ("none", "yarn"), f"rope_scaling must be 'none' or 'yarn', got {self.rope_scaling!r}")
    if self.rope_scaling == "yarn":
      need(self.attention_type == "mla", "rope_scaling 'yarn' is supported with MLA only")
      need(
        self.rope_factor >= 1.0 and self.rope_original_max_len > 0,
        "yarn needs rope_factor >= 1 and rope_original_max_len > 0",
      )
    need(self.shared_expert_hidden >= 0, "shared_expert_hidden must be >= 0")
    need(not self.shared_expert_gate or self.n_shared_experts > 0, "shared_expert_gate needs n_shared_experts > 0")

  @property
  def n_moe_layers(self) -> int:
    return self.n_layers - self.first_k_dense

  def is_moe_layer(self, layer: int) -> bool:
    return layer >= self.first_k_dense

  @property
  def moe_layers(self) -> list[int]:
    """The MoE layers' indices (from 0), in order: the L axis of routing traces and statistics."""
    return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

  @property
  def shared_width(self) -> int:
    """Width of the fused shared-expert SwiGLU (0 without shared experts)."""
    if not self.n_shared_experts:
      return 0
    return self.shared_expert_hidden or self.n_shared_experts * self.expert_hidden

  @property
  def cache_dims(self) -> tuple[int, int, int]:
    """(heads, key dim, value dim) of one cache entry: MLA caches its latent and rope key."""
    if self.attention_type == "mla":
      return 1, self.kv_lora_rank, self.qk_rope_head_dim
    return self.n_kv_heads, self.head_dim, self.head_dim

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
    return dataclass_from_dict(cls, d, "ModelConfig: unknown fields")

  def param_counts(self) -> dict[str, int]:
    """Total and per-token active parameter counts (embeddings included)."""
    d, e, f = self.d_model, self.n_routed_experts, self.expert_hidden
    h, hkv, dh = self.n_heads, self.n_kv_heads, self.head_dim
    if self.attention_type == "mla":
      qk = self.qk_nope_head_dim + self.qk_rope_head_dim
      c, r = self.kv_lora_rank, self.qk_rope_head_dim
      q = d * h * qk if not self.q_lora_rank else (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk)
      attn = q + d * (c + r) + c + c * h * (self.qk_nope_head_dim + self.v_head_dim)
      attn += h * self.v_head_dim * d
    else:
      attn = d * h * dh * 2 + d * hkv * dh * 2
      attn += (h + 2 * hkv) * dh if self.qkv_bias else 0
      attn += {"none": 0, "head": 2 * dh, "full": (h + hkv) * dh}[self.qk_norm]
    norms = 2 * d
    dense_ffn = 3 * d * self.dense_hidden
    shared = 3 * d * self.shared_width + (d if self.shared_expert_gate else 0)
    router = d * e + (e if self.use_score_bias else 0)  # the routing correction bias (DeepSeek-V3)
    expert = 3 * d * f
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d
    total = emb + self.n_layers * (attn + norms)
    active = total
    total += self.first_k_dense * dense_ffn + self.n_moe_layers * (router + shared + e * expert)
    active += self.first_k_dense * dense_ffn + self.n_moe_layers * (router + shared + self.top_k * expert)
    return {"total": total, "active": active}


_D = TypeVar("_D")


def dataclass_from_dict(cls: type[_D], d: Any, unknown_message: str) -> _D:
  """`cls(**d)` from a mapping or ConfigDict, refusing fields `cls` does not have."""
  d = d.to_dict() if hasattr(d, "to_dict") else dict(d)
  unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
  if unknown:
    raise ValueError(f"{unknown_message} {unknown}")
  return cls(**d)


def model_config_from(cfg: Any) -> ModelConfig:
  """A ModelConfig from a `configs/*.py` ConfigDict's `model` field (or any mapping)."""
  as_dict = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
  return ModelConfig.from_dict(as_dict)
