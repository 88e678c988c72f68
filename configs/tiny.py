"""The default trained model: a fine-grained MoE (DeepSeek-V2-Lite-like ratios) trainable on 2 CPU cores.

32 small routed experts, top-4, one shared expert, first layer dense; a byte-level BPE of 2048
tokens trained on the corpus (within the demo's training time it reached a lower validation bits per
byte than raw bytes and than a 1024-token BPE; a 4096-token BPE's steps cover fewer bytes a second:
docs/findings/2026-12-07-default-model-tokenizer.md).
"""

import ml_collections


def model_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    dict(
      vocab_size=2048,
      d_model=256,
      n_layers=5,
      n_heads=4,
      n_kv_heads=2,
      head_dim=64,
      rope_theta=10000.0,
      norm_eps=1e-6,
      max_seq_len=512,
      n_routed_experts=32,
      top_k=4,
      n_shared_experts=1,
      expert_hidden=128,
      dense_hidden=768,
      first_k_dense=1,
      score_func="softmax",
      norm_topk_prob=True,
      routed_scaling_factor=1.0,
      n_groups=1,
      topk_groups=1,
      use_score_bias=False,
      num_mtp_modules=0,
      tie_embeddings=False,
      eos_id=0,  # the BPE's special tokens come first
      bos_id=1,
      tokenizer="bpe-2048",
      dtype="float32",
      expert_method="auto",
    )
  )


def train_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    dict(
      seed=0,
      batch_size=8,
      seq_len=256,
      # What a fresh `make demo` affords on 2 cores within its 15 minutes with the 2048-token BPE,
      # more steps left no margin (docs/findings/2026-12-04-make-demo.md, "Fitting the quarter of an hour").
      steps=350,
      learning_rate=3e-3,
      min_lr_ratio=0.1,
      warmup_steps=50,
      weight_decay=0.1,
      grad_clip=1.0,
      b1=0.9,
      b2=0.95,
      aux_loss_weight=0.01,
      bias_update_rate=1e-3,
      eval_every=100,
      # Batches spread over the validation split for the curve; 8 were not a fair sample of it
      # (docs/findings/2026-12-07-default-model-tokenizer.md).
      eval_batches=16,
      checkpoint_every=100,
      log_every_seconds=10.0,
    )
  )


def mtp_config() -> ml_collections.ConfigDict:
  """MTP drafter heads trained on the frozen target (experiments/train_mtp.py, `make demo`)."""
  return ml_collections.ConfigDict(
    dict(
      seed=0,
      num_mtp_modules=1,
      loss="distill",
      batch_size=8,
      seq_len=256,
      # The whole schedule within the demo's time budget for the heads (default_model.py; the
      # steps' time: docs/findings/2026-12-04-make-demo.md).
      steps=240,
      learning_rate=3e-3,
      min_lr_ratio=0.1,
      warmup_steps=30,
      weight_decay=0.0,
      grad_clip=1.0,
      eval_batches=8,
      checkpoint_every=100,
      log_every_seconds=10.0,
      time_budget_s=0.0,
      dense_hidden=256,  # a dense FFN: draft steps read no routed expert (docs/findings/2026-12-07-dense-mtp-heads.md)
    )
  )


def get_config() -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.name = "tiny"
  cfg.model = model_config()
  cfg.train = train_config()
  cfg.mtp = mtp_config()
  return cfg
