"""Shape-only config: gpt-oss-20b (21B total, 3.6B active); its attention sinks and biases,
sliding window and clamped SwiGLU are not modelled here.

The published dimensions, for kernel benchmarks and the cost model; the weights are not here.
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.name = "gpt_oss_20b"
  cfg.model.update(
    dict(
      vocab_size=201088,
      d_model=2880,
      n_layers=24,
      n_heads=64,
      n_kv_heads=8,
      head_dim=64,
      rope_theta=150000.0,
      max_seq_len=4096,
      n_routed_experts=32,
      top_k=4,
      n_shared_experts=0,
      expert_hidden=2880,
      dense_hidden=2880,
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
