"""Random Hugging Face checkpoints of the supported MoE families, built offline.

For the import tests and experiments/peer_bench.py: needs torch and transformers (the `dev`
extra), imported lazily, so nothing at run time depends on them.
"""

from __future__ import annotations

import pathlib

YARN = {
  "rope_type": "yarn",
  "rope_theta": 10000.0,
  "factor": 4.0,
  "original_max_position_embeddings": 32,
  "beta_fast": 32.0,
  "beta_slow": 1.0,
  "mscale": 1.0,
  "mscale_all_dim": 1.0,
}

TINY = dict(vocab=256, hidden=32, layers=2, heads=4, experts=8, top_k=2, moe_hidden=16, max_len=128)


def family_config(family: str, **size):
  """A transformers config of `family`; `size` overrides TINY's knobs."""
  import transformers  # pylint: disable=g-import-not-at-top

  s = {**TINY, **size}
  d, f, e, h = s["hidden"], s["moe_hidden"], s["experts"], s["heads"]
  common = dict(
    vocab_size=s["vocab"],
    hidden_size=d,
    num_hidden_layers=s["layers"],
    num_attention_heads=h,
    max_position_embeddings=s["max_len"],
    initializer_range=0.1,
    eos_token_id=s["vocab"] - 1,
    bos_token_id=s["vocab"] - 2,
    pad_token_id=None,
    num_experts_per_tok=s["top_k"],
  )
  rope = d // h // 4 * 2 or 2
  mla = dict(
    num_key_value_heads=h,
    kv_lora_rank=d // 2,
    qk_nope_head_dim=d // h,
    qk_rope_head_dim=rope,
    v_head_dim=d // h,
    first_k_dense_replace=1,
    intermediate_size=2 * d,
    moe_intermediate_size=f,
    n_routed_experts=e,
  )
  deep = {**common, "num_hidden_layers": s["layers"] + 1}
  if family == "mixtral":
    return transformers.MixtralConfig(
      **common,
      num_key_value_heads=h // 2,
      intermediate_size=f,
      num_local_experts=e,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      rms_norm_eps=1e-5,
    )
  if family == "qwen2_moe":
    return transformers.Qwen2MoeConfig(
      **common,
      num_key_value_heads=h // 2,
      intermediate_size=2 * f,
      moe_intermediate_size=f,
      shared_expert_intermediate_size=f * 5 // 2,
      num_experts=e,
      norm_topk_prob=False,
      tie_word_embeddings=True,
    )
  if family == "qwen3_moe":
    return transformers.Qwen3MoeConfig(
      **common,
      num_key_value_heads=h // 2,
      head_dim=2 * d // h,
      intermediate_size=2 * f,
      moe_intermediate_size=f,
      num_experts=e,
      norm_topk_prob=True,
    )
  if family == "olmoe":
    return transformers.OlmoeConfig(
      **common, num_key_value_heads=h // 2, intermediate_size=f, num_experts=e, norm_topk_prob=False
    )
  if family == "deepseek_v2":
    return transformers.DeepseekV2Config(
      **deep,
      **mla,
      n_shared_experts=2,
      q_lora_rank=None,
      topk_method="group_limited_greedy",
      n_group=4,
      topk_group=2,
      routed_scaling_factor=1.5,
    )
  if family == "deepseek_v3":
    return transformers.DeepseekV3Config(
      **deep,
      **mla,
      n_shared_experts=1,
      q_lora_rank=d * 3 // 4,
      n_group=4,
      topk_group=2,
      routed_scaling_factor=2.5,
      norm_topk_prob=True,
      rope_parameters={**YARN, "original_max_position_embeddings": s["max_len"] // 4},
    )
  raise ValueError(f"unknown family {family!r}")


def build(family: str, directory, *, seed: int = 0, save_kwargs: dict | None = None, **size):
  """Builds a random `family` model (norms and biases perturbed too), saves it, returns it."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(family_config(family, **size)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.05 * torch.randn_like(b))
  model.save_pretrained(pathlib.Path(directory), **(save_kwargs or {}))
  return model
