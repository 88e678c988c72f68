"""Pretrain the target MoE LM on the embedded corpus.

  python -m experiments.pretrain --config=configs/tiny.py --workdir=runs/pretrain
      [--config.train.steps=3000] [--export_default] [--quick]

Resumes from `workdir/checkpoints` when interrupted; writes `workdir/metrics.json`,
`workdir/loss.png` and the final model in `workdir/model` (loadable with `Model.load`).
"""

from absl import flags
from ml_collections import config_flags

from moespec_jax import cli
from moespec_jax.config import model_config_from
from moespec_jax.io import paths
from moespec_jax.training import pretrain

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Model and training config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/pretrain", "Output directory (resumable).")
_EXPORT = flags.DEFINE_bool("export_default", False, "Also save the trained model as the default model in the cache.")
_QUICK = cli.define_quick_flag(
  "a few short steps of the config's model",
  {
    "config.train.steps": 20,
    "config.train.warmup_steps": 2,
    "config.train.batch_size": 4,
    "config.train.seq_len": 64,
    "config.train.eval_every": 10,
    "config.train.eval_batches": 1,
    "config.train.checkpoint_every": 10,
  },
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if _QUICK.value and _EXPORT.value:
    raise ValueError("--export_default does not go with --quick: a smoke run's model is not the default model")
  cfg = _CONFIG.value
  model, metrics = pretrain.train(
    model_config_from(cfg.model),
    pretrain.TrainConfig.from_dict(cfg.train),
    _WORKDIR.value,
    config_name=cfg.get("name", ""),
  )
  print(
    f"validation bits/byte (whole split): {metrics['final_val_bits_per_byte']:.4f}; "
    f"train tokens/s: {metrics.get('train_tokens_per_second', float('nan')):,.0f}"
  )
  if _EXPORT.value:
    print(f"default model saved to {model.save(paths.default_model_dir())}")
  print(f"wrote {_WORKDIR.value}/metrics.json, {_WORKDIR.value}/loss.png and {_WORKDIR.value}/model")


if __name__ == "__main__":
  cli.run(main, resumable=True)
