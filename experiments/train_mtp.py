"""Train MTP drafter heads on a frozen target (default: the default model's target).

  python -m experiments.train_mtp --workdir=runs/train_mtp [--config.mtp.loss=ce]
      [--config.mtp.steps=400] [--model=DIR (aliases --target, --checkpoint)] [--save_default]
      [--nodraft_cost] [--quick]

Resumes from `workdir/checkpoints`; writes `workdir/metrics.json` (key `train_mtp`: training
curve, teacher-forced per-depth acceptance on held-out text, acceptance by depth measured by
speculative decoding of held-out prompts, a draft step's time over a plain pass), `workdir/mtp.png`
(loss, acceptance by depth) and the model with its heads in `workdir/model`.
"""

import pathlib

from absl import flags
from ml_collections import config_flags

from moespec_jax import cli
from moespec_jax.io import atomic, paths
from moespec_jax.training import mtp

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config with an `mtp` section.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/train_mtp", "Output directory (resumable).")
_MODEL = cli.define_model_flag(
  unset="the default model's target, trained and cached on first use", aliases=("checkpoint", "target")
)
_SAVE_DEFAULT = flags.DEFINE_bool("save_default", False, "Also save target + heads as the default model in the cache.")
_PROMPTS = flags.DEFINE_integer(
  "acceptance_prompts", 8, "Held-out prompts decoded to measure acceptance by depth.", lower_bound=1
)
_TOKENS = flags.DEFINE_integer("acceptance_tokens", 96, "Tokens generated per prompt for that measure.", lower_bound=1)
_DRAFT_COST = flags.DEFINE_bool(
  "draft_cost", True, "Also time a draft step against a plain pass (loop.draft_step_ms, K = 1..4)."
)
_QUICK = cli.define_quick_flag(
  "a few short steps",
  {
    "config.mtp.steps": 20,
    "config.mtp.warmup_steps": 2,
    "config.mtp.batch_size": 4,
    "config.mtp.seq_len": 64,
    "config.mtp.eval_batches": 1,
    "config.mtp.checkpoint_every": 10,
    "acceptance_prompts": 2,
    "acceptance_tokens": 16,
  },
)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if _QUICK.value and _SAVE_DEFAULT.value:
    raise ValueError("--save_default does not go with --quick: a smoke run's heads are not the default model's")
  cfg = _CONFIG.value
  if "mtp" not in cfg:
    raise ValueError("--config has no `mtp` section")
  tc = mtp.MTPTrainConfig.from_dict(cfg.mtp)
  target = cli.load_model(_MODEL.value, train_heads=False)
  model, metrics = mtp.train(target, tc, _WORKDIR.value)
  metrics["decoding"] = mtp.decoding_acceptance(model, n_prompts=_PROMPTS.value, max_new_tokens=_TOKENS.value)
  if _DRAFT_COST.value:
    print("timing a draft step against a plain pass (controlled drafter, with and without the heads' drafting)")
    metrics["draft_cost"] = mtp.draft_cost(model, repeats=3 if _QUICK.value else 7)
  workdir = pathlib.Path(_WORKDIR.value)
  atomic.write_json_atomic(workdir / "metrics.json", {"train_mtp": metrics})
  mtp.plot_mtp(metrics, workdir / "mtp.png")
  for row in metrics["teacher_forced"]:
    print(
      f"depth {row['depth']}: greedy acceptance {row['greedy_acceptance']:.3f}, expected "
      f"acceptance at T=1 {row['expected_acceptance_t1']:.3f}, ce {row['ce']:.3f}"
    )
  for name, d in metrics["decoding"].items():
    accs = ", ".join(f"{a:.3f}" for a in d["acceptance_by_depth"])
    print(f"decoding ({name}, K=4): acceptance by depth [{accs}], mean accepted length {d['mean_accepted_length']:.2f}")
  if "draft_cost" in metrics:
    c = metrics["draft_cost"]
    over = ", ".join(f"{x:.2f}" for x in c["draft_over_plain_pass_by_k"])
    print(f"a draft step over a plain pass ({c['plain_pass_ms']:.3f} ms), K = 1..{len(c['draft_ms_by_k'])}: {over}")
  if _SAVE_DEFAULT.value:
    print(f"default model saved to {model.save(paths.default_model_dir())}")
  print(f"wrote {workdir / 'metrics.json'}, {workdir / 'mtp.png'} and {workdir / 'model'}")


if __name__ == "__main__":
  cli.run(main, resumable=True)
