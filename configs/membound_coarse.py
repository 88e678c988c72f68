"""A memory-bound model, coarse-grained experts (Mixtral-like ratios), randomly initialised.

d_model 1024, 3 MoE layers of 8 experts top-2 (hidden 2816), no shared expert, one MTP module.
Each pass reads far more weight bytes than the last-level cache holds, and one token's products
are matrix-vector products bound by memory: the regime the seeds study. Not trained: run it with
`--model=config:membound_coarse` (random weights, byte tokenizer; acceptance from the controlled
drafter). `tiny()` gives the same layout at test size.
"""

import ml_collections

from configs import tiny as tiny_config


def get_config() -> ml_collections.ConfigDict:
  cfg = tiny_config.get_config()
  cfg.name = "membound_coarse"
  cfg.model.update(
    d_model=1024,
    n_layers=3,
    n_heads=8,
    n_kv_heads=2,
    head_dim=128,
    max_seq_len=512,
    n_routed_experts=8,
    top_k=2,
    n_shared_experts=0,
    expert_hidden=2816,
    first_k_dense=0,
    num_mtp_modules=1,
  )
  return cfg


def tiny() -> ml_collections.ConfigDict:
  """The same layout at test size (8 experts top-2, no shared expert, MTP module)."""
  cfg = get_config()
  cfg.name = "membound_coarse_tiny"
  cfg.model.update(d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, expert_hidden=96)
  return cfg
