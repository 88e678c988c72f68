"""Shape-only config: DeepSeek-V2-Lite (15.7B total, 2.4B active), the seeds' headline model.

The published dimensions (MLA attention with its 512 + 64 compressed cache, queries projected
directly, YaRN rope), for kernel benchmarks and the cost model; the weights are not here
(`Model.load` reads a local checkpoint).
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.name = "deepseek_v2_lite"
  cfg.model.update(
    dict(
      vocab_size=102400,
      d_model=2048,
      n_layers=27,
      n_heads=16,
      n_kv_heads=16,
      head_dim=64,
      attention_type="mla",
      q_lora_rank=0,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      rope_theta=10000.0,
      rope_scaling="yarn",
      rope_factor=40.0,
      rope_original_max_len=4096,
      rope_mscale=0.707,
      rope_mscale_all_dim=0.707,
      max_seq_len=4096,
      n_routed_experts=64,
      top_k=6,
      n_shared_experts=2,
      expert_hidden=1408,
      dense_hidden=10944,
      first_k_dense=1,
      score_func="softmax",
      norm_topk_prob=False,
      routed_scaling_factor=1.0,
      n_groups=1,
      topk_groups=1,
      tokenizer="none",
      eos_id=100001,
      bos_id=100000,
    )
  )
  return cfg
