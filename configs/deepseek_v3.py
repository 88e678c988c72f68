"""Shape-only config: DeepSeek-V3 (671B total, 37B active) with its MTP layer.

The published dimensions (MLA with low-rank queries, sigmoid routing with a correction bias over
8 groups of which 4 are kept, three dense layers first, YaRN rope, one MTP module with its own
norm before the shared output head), for kernel benchmarks and the cost model; the weights are
not here (`Model.load` reads a local checkpoint).
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  cfg = tiny.get_config()
  cfg.name = "deepseek_v3"
  cfg.model.update(
    dict(
      vocab_size=129280,
      d_model=7168,
      n_layers=61,
      n_heads=128,
      n_kv_heads=128,
      head_dim=64,
      attention_type="mla",
      q_lora_rank=1536,
      kv_lora_rank=512,
      qk_nope_head_dim=128,
      qk_rope_head_dim=64,
      v_head_dim=128,
      rope_theta=10000.0,
      rope_scaling="yarn",
      rope_factor=40.0,
      rope_original_max_len=4096,
      rope_mscale=1.0,
      rope_mscale_all_dim=1.0,
      max_seq_len=4096,
      n_routed_experts=256,
      top_k=8,
      n_shared_experts=1,
      expert_hidden=2048,
      dense_hidden=18432,
      first_k_dense=3,
      score_func="sigmoid",
      use_score_bias=True,
      norm_topk_prob=True,
      routed_scaling_factor=2.5,
      n_groups=8,
      topk_groups=4,
      num_mtp_modules=1,
      mtp_head_norm=True,
      tokenizer="none",
      eos_id=1,
      bos_id=0,
    )
  )
  return cfg
