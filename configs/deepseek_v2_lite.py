"""Shape-only config: DeepSeek-V2-Lite (15.7B total, 2.4B active). Attention is MLA in the real model (kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128); here GQA with 16 kv heads stands in until MLA lands.

The published dimensions, for kernel benchmarks and the cost model; the weights are not here.
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.name = "deepseek_v2_lite"
  cfg.model.update(dict(
      vocab_size=102400,
      d_model=2048,
      n_layers=27,
      n_heads=16,
      n_kv_heads=16,
      head_dim=128,
      rope_theta=10000.0,
      max_seq_len=4096,
      n_routed_experts=64,
      top_k=6,
      n_shared_experts=2,
      expert_hidden=1408,
      dense_hidden=10944,
      first_k_dense=1,
      score_func='softmax',
      norm_topk_prob=False,
      routed_scaling_factor=1.0,
      n_groups=1,
      topk_groups=1,
      tokenizer="none", eos_id=0, bos_id=1))
  return cfg
