"""A larger model than tiny, for longer runs: 64 experts top-6, two shared, d_model 384."""

from configs import tiny


def get_config():
  cfg = tiny.get_config()
  cfg.name = "small"
  cfg.model.update(
    d_model=384,
    n_layers=8,
    n_heads=6,
    n_kv_heads=2,
    head_dim=64,
    n_routed_experts=64,
    top_k=6,
    n_shared_experts=2,
    expert_hidden=128,
    dense_hidden=1152,
  )
  cfg.train.update(steps=6000, learning_rate=2e-3)
  return cfg
