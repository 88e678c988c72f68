"""Shape-only config: Mixtral-8x7B (46.7B total, 12.9B active).

The published dimensions, for kernel benchmarks and the cost model; the weights are not here.
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.name = "mixtral_8x7b"
  cfg.model.update(
    dict(
      vocab_size=32000,
      d_model=4096,
      n_layers=32,
      n_heads=32,
      n_kv_heads=8,
      head_dim=128,
      rope_theta=1000000.0,
      max_seq_len=4096,
      n_routed_experts=8,
      top_k=2,
      n_shared_experts=0,
      expert_hidden=14336,
      dense_hidden=14336,
      first_k_dense=0,
      score_func="softmax",
      norm_topk_prob=True,
      routed_scaling_factor=1.0,
      n_groups=1,
      topk_groups=1,
      tokenizer="none",
      eos_id=2,
      bos_id=1,
    )
  )
  return cfg
