"""Train MTP drafter heads on a frozen target (default: the default model's target).

  python -m experiments.train_mtp --workdir=runs/train_mtp [--config.mtp.loss=ce] \
      [--config.mtp.steps=400] [--target=PATH (alias --model)] [--save_default]

Resumes from `workdir/checkpoints`; writes `workdir/metrics.json` (key `train_mtp`: training
curve, teacher-forced per-depth acceptance on held-out text, acceptance by depth measured by
speculative decoding of held-out prompts) and the model with its heads in `workdir/model`.
"""

from absl import flags
from ml_collections import config_flags

from moespec_jax import cli
from moespec_jax.io import atomic, paths
from moespec_jax.training import mtp

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config with an `mtp` section.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/train_mtp", "Output directory (resumable).")
_TARGET = flags.DEFINE_string("target", None, "Target model directory, ours or a Hugging Face one (default: the "
                              "default model's target); alias --model.")
flags.DEFINE_alias("model", "target")
_SAVE_DEFAULT = flags.DEFINE_bool("save_default", False,
                                  "Also save target + heads as the default model in the cache.")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  cfg = _CONFIG.value
  if "mtp" not in cfg:
    raise ValueError("--config has no `mtp` section")
  tc = mtp.MTPTrainConfig.from_dict(cfg.mtp)
  target = cli.load_model(_TARGET.value, train_heads=False)
  model, metrics = mtp.train(target, tc, _WORKDIR.value)
  metrics["decoding"] = mtp.decoding_acceptance(model)
  atomic.write_json_atomic(f"{_WORKDIR.value}/metrics.json", {"train_mtp": metrics})
  for row in metrics["teacher_forced"]:
    print(f"depth {row['depth']}: greedy acceptance {row['greedy_acceptance']:.3f}, expected "
          f"acceptance at T=1 {row['expected_acceptance_t1']:.3f}, ce {row['ce']:.3f}")
  for name, d in metrics["decoding"].items():
    accs = ", ".join(f"{a:.3f}" for a in d["acceptance_by_depth"])
    print(f"decoding ({name}, K=4): acceptance by depth [{accs}], mean accepted length "
          f"{d['mean_accepted_length']:.2f}")
  if _SAVE_DEFAULT.value:
    print(f"default model saved to {model.save(paths.default_model_dir())}")


if __name__ == "__main__":
  cli.run(main)
