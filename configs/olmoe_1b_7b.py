"""Shape-only config: OLMoE-1B-7B (6.9B total, 1.3B active), with its q/k RMSNorm (over all heads).

The published dimensions, for kernel benchmarks and the cost model; the weights are not here.
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.name = "olmoe_1b_7b"
  cfg.model.update(
    dict(
      vocab_size=50304,
      d_model=2048,
      n_layers=16,
      n_heads=16,
      n_kv_heads=16,
      head_dim=128,
      qk_norm="full",
      rope_theta=10000.0,
      max_seq_len=4096,
      n_routed_experts=64,
      top_k=8,
      n_shared_experts=0,
      expert_hidden=1024,
      dense_hidden=1024,
      first_k_dense=0,
      score_func="softmax",
      norm_topk_prob=False,
      routed_scaling_factor=1.0,
      n_groups=1,
      topk_groups=1,
      tokenizer="none",
      eos_id=0,
      bos_id=1,
    )
  )
  return cfg
