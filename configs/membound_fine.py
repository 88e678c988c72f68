"""A memory-bound model, fine-grained experts (DeepSeek/Qwen-like ratios), randomly initialised.

d_model 1024, 3 MoE layers of 64 experts top-6 (hidden 512) and one shared expert, one MTP
module. Like `membound_coarse`, each pass reads far more weight bytes than the last-level cache
holds; run it with `--model=config:membound_fine`. `tiny()` gives the same layout at test size.
"""

import ml_collections

from configs import membound_coarse


def get_config() -> ml_collections.ConfigDict:
  cfg = membound_coarse.get_config()
  cfg.name = "membound_fine"
  cfg.model.update(n_routed_experts=64, top_k=6, n_shared_experts=1, expert_hidden=512)
  return cfg


def tiny() -> ml_collections.ConfigDict:
  """The same layout at test size (64 experts top-6, one shared expert, MTP module)."""
  cfg = get_config()
  cfg.name = "membound_fine_tiny"
  cfg.model.update(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, expert_hidden=32)
  return cfg
