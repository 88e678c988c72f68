"""Shape-only config: Qwen3-30B-A3B (30.5B total, 3.3B active), with its q/k RMSNorm (per head).

The published dimensions, for kernel benchmarks and the cost model; the weights are not here.
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.name = "qwen3_30b_a3b"
  cfg.model.update(
    dict(
      vocab_size=151936,
      d_model=2048,
      n_layers=48,
      n_heads=32,
      n_kv_heads=4,
      head_dim=128,
      qk_norm="head",
      rope_theta=1000000.0,
      max_seq_len=4096,
      n_routed_experts=128,
      top_k=8,
      n_shared_experts=0,
      expert_hidden=768,
      dense_hidden=6144,
      first_k_dense=0,
      score_func="softmax",
      norm_topk_prob=True,
      routed_scaling_factor=1.0,
      n_groups=1,
      topk_groups=1,
      tokenizer="none",
      eos_id=0,
      bos_id=1,
    )
  )
  return cfg
