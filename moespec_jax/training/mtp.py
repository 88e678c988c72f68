"""Training MTP drafter heads on a frozen target: cross-entropy or distillation, optax, orbax.

Only the MTP modules train; the target (embedding, blocks, final norm, output head, shared
with the heads) is frozen. Losses, per depth k (module k at index i predicts t_{i+k+1}):
- "ce": cross-entropy on the true next tokens of the corpus;
- "distill": cross-entropy toward the target's own distribution at the same position
  (equivalently KL(p_target || q), the quantity that drives acceptance).
Evaluation on held-out text (teacher forcing): per depth, the greedy acceptance (argmax of
the head equals the target's argmax) and the expected sampled acceptance at temperature 1,
sum_x min(p(x), q(x)).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moespec_jax.api import Model
from moespec_jax.config import dataclass_from_dict
from moespec_jax.data import batches as batches_lib
from moespec_jax.io import atomic, checkpoint, plots
from moespec_jax.io.progress import Progress
from moespec_jax.model import Transformer
from moespec_jax.model import mtp as mtp_lib
from moespec_jax.training import losses

if TYPE_CHECKING:
  import ml_collections

LOSSES = ("ce", "distill")


@dataclasses.dataclass(frozen=True)
class MTPTrainConfig:
  seed: int = 0
  num_mtp_modules: int = 1
  loss: str = "distill"
  batch_size: int = 8
  seq_len: int = 256
  steps: int = 400
  learning_rate: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 30
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  eval_batches: int = 8
  checkpoint_every: int = 100
  log_every_seconds: float = 10.0
  # Stops early (keeping what is trained) after this many seconds; 0 disables.
  time_budget_s: float = 0.0
  # The heads' FFN: 0, as the target's layers (MoE); > 0, a dense SwiGLU of this width
  # (`ModelConfig.mtp_dense_hidden`: draft steps that read no routed expert).
  dense_hidden: int = 0

  def __post_init__(self) -> None:
    if self.loss not in LOSSES:
      raise ValueError(f"mtp.loss must be one of {LOSSES}, got {self.loss!r}")
    for name in ("num_mtp_modules", "batch_size", "seq_len", "steps", "eval_batches", "checkpoint_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"mtp.{name} must be >= 1, got {getattr(self, name)}")
    if self.dense_hidden < 0:
      raise ValueError(f"mtp.dense_hidden must be >= 0, got {self.dense_hidden}")
    if self.learning_rate <= 0:
      raise ValueError(f"mtp.learning_rate must be > 0, got {self.learning_rate}")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any] | ml_collections.ConfigDict) -> MTPTrainConfig:
    return dataclass_from_dict(cls, d, "unknown mtp config fields")


def _is_mtp_param(path: tuple[Any, ...], value: object) -> bool:
  return isinstance(value, nnx.Param) and "mtp" in path


def with_fresh_heads(target: Model, num_mtp_modules: int, seed: int, dense_hidden: int = 0) -> Transformer:
  """A module holding `target`'s parameters and newly initialised MTP heads (a dense FFN of width
  `dense_hidden` where > 0, else the target layers' FFN)."""
  config = target.config.replace(num_mtp_modules=num_mtp_modules, mtp_dense_hidden=dense_hidden)
  module = Transformer(config, rngs=nnx.Rngs(seed))
  state = nnx.state(module)
  pure = nnx.to_pure_dict(state)
  old = nnx.to_pure_dict(target.state)
  for key in old:
    if key != "mtp":
      pure[key] = old[key]
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(module, state)
  return module


def split_heads(module: Transformer) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, trainable MTP params, frozen rest)."""
  return nnx.split(module, _is_mtp_param, ...)


def depth_losses(
  module: Transformer, tokens_BT: jax.Array, depths: int
) -> list[tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
  """Per depth: (ce on true tokens, distillation ce toward the target, greedy match, min(p, q) mass)."""
  out = module(tokens_BT)
  hidden = jax.lax.stop_gradient(out.hidden)
  target_logits_BTV = jax.lax.stop_gradient(out.logits)
  t = tokens_BT.shape[1]
  results = []
  for k, logits_BNV in enumerate(mtp_lib.forward_train(module, hidden, tokens_BT, depths), start=1):
    n = t - k - 1
    truth_BN = tokens_BT[:, k + 1 :]
    p_logits_BNV = target_logits_BTV[:, k : k + n]
    logq_BNV = jax.nn.log_softmax(logits_BNV.astype(jnp.float32), axis=-1)
    p_BNV = jax.nn.softmax(p_logits_BNV, axis=-1)
    ce = jnp.mean(losses.cross_entropy(logits_BNV, truth_BN))
    distill = jnp.mean(-jnp.sum(p_BNV * logq_BNV, axis=-1))
    greedy = jnp.mean(jnp.argmax(logits_BNV, -1) == jnp.argmax(p_logits_BNV, -1))
    expected = jnp.mean(jnp.sum(jnp.minimum(p_BNV, jnp.exp(logq_BNV)), axis=-1))
    results.append((ce, distill, greedy, expected))
  return results


def make_optimizer(tc: MTPTrainConfig) -> optax.GradientTransformation:
  warmup = min(tc.warmup_steps, tc.steps - 1)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, tc.learning_rate, warmup, max(tc.steps, warmup + 1), tc.learning_rate * tc.min_lr_ratio
  )
  return optax.chain(
    optax.clip_by_global_norm(tc.grad_clip), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay)
  )


def _loss_fn(
  heads: nnx.State, rest: nnx.State, batch_BT: jax.Array, graphdef: nnx.GraphDef, tc: MTPTrainConfig
) -> tuple[jax.Array, list[tuple[jax.Array, ...]]]:
  module = nnx.merge(graphdef, heads, rest)
  per_depth = depth_losses(module, batch_BT, tc.num_mtp_modules)
  pick = 0 if tc.loss == "ce" else 1
  loss = sum(r[pick] for r in per_depth) / tc.num_mtp_modules
  return loss, per_depth


@functools.partial(jax.jit, static_argnums=(0, 1))
def train_step(
  graphdef: nnx.GraphDef,
  tc: MTPTrainConfig,
  heads: nnx.State,
  rest: nnx.State,
  opt_state: optax.OptState,
  batch_BT: jax.Array,
) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array]]:
  """One optimizer step on the heads; the frozen target (`rest`) is an argument, not a constant."""
  (loss, per_depth), grads = jax.value_and_grad(_loss_fn, has_aux=True)(heads, rest, batch_BT, graphdef, tc)
  updates, opt_state = make_optimizer(tc).update(grads, opt_state, heads)
  heads = optax.apply_updates(heads, updates)
  return heads, opt_state, {"loss": loss, "ce_1": per_depth[0][0], "greedy_1": per_depth[0][2]}


@functools.partial(jax.jit, static_argnums=(0, 1))
def eval_step(graphdef: nnx.GraphDef, depths: int, heads: nnx.State, rest: nnx.State, batch_BT: jax.Array) -> jax.Array:
  module = nnx.merge(graphdef, heads, rest)
  return jnp.asarray(depth_losses(module, batch_BT, depths))  # [depths, 4]


def evaluate(
  graphdef: nnx.GraphDef, heads: nnx.State, rest: nnx.State, val_tokens: np.ndarray, tc: MTPTrainConfig
) -> list[dict[str, float]]:
  """Teacher-forced per-depth figures on held-out windows."""
  rows = []
  for vb in batches_lib.validation_batches(val_tokens, tc.batch_size, tc.seq_len - 1, max_batches=tc.eval_batches):
    rows.append(np.asarray(eval_step(graphdef, tc.num_mtp_modules, heads, rest, jnp.asarray(vb.tokens))))
  mean = np.mean(rows, axis=0)
  return [
    {
      "depth": k + 1,
      "ce": float(m[0]),
      "distill_ce": float(m[1]),
      "greedy_acceptance": float(m[2]),
      "expected_acceptance_t1": float(m[3]),
    }
    for k, m in enumerate(mean)
  ]


def train(
  target: Model, tc: MTPTrainConfig, workdir: atomic.PathLike, *, log: Callable[[str], None] = print
) -> tuple[Model, dict[str, Any]]:
  """Trains (or resumes) MTP heads on the frozen `target`; returns target + heads and metrics.

  `workdir/checkpoints` holds resumable state, `workdir/model` the model with heads.
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  if tc.seq_len > target.config.max_seq_len:
    raise ValueError(f"mtp.seq_len ({tc.seq_len}) exceeds the model's max_seq_len ({target.config.max_seq_len})")
  tokenizer = target.tokenizer
  train_tokens = batches_lib.corpus_tokens(tokenizer, "train")
  val_tokens = batches_lib.corpus_tokens(tokenizer, "validation")

  module = with_fresh_heads(target, tc.num_mtp_modules, tc.seed, tc.dense_hidden)
  graphdef, heads, rest = split_heads(module)
  opt_state = make_optimizer(tc).init(heads)

  metrics: dict[str, Any] = {"train_config": dataclasses.asdict(tc), "train_curve": []}
  manager = checkpoint.CheckpointManager(
    workdir / "checkpoints", max_to_keep=2, save_interval_steps=tc.checkpoint_every
  )
  start = 0
  if manager.latest_step() is not None:
    start = manager.latest_step()
    state = manager.restore(start, checkpoint.abstract_tree({"heads": heads, "opt_state": opt_state, "step": 0}))
    heads, opt_state = state["heads"], state["opt_state"]
    prev = workdir / "metrics.json"
    if prev.exists():
      old = json.loads(prev.read_text()).get("train_mtp", {})
      metrics["train_curve"] = [r for r in old.get("train_curve", []) if r["step"] <= start]
    log(f"resuming MTP training from step {start}")

  tokens_per_step = tc.batch_size * tc.seq_len
  progress = Progress(tc.steps, desc="mtp", unit="tokens", every_s=tc.log_every_seconds, start_step=start, emit=log)
  began = time.perf_counter()
  step = start
  for step in range(start + 1, tc.steps + 1):
    batch = batches_lib.train_batch(train_tokens, tc.batch_size, tc.seq_len - 1, tc.seed + 1, step)
    heads, opt_state, m = train_step(graphdef, tc, heads, rest, opt_state, jnp.asarray(batch))
    m = {k: float(v) for k, v in m.items()}
    if not np.isfinite(m["loss"]):
      raise FloatingPointError(f"MTP loss is {m['loss']} at step {step}")
    if step % 10 == 0 or step == tc.steps:
      metrics["train_curve"].append({"step": step, **m})
    progress.update(step, tokens_per_step, loss=m["loss"], greedy_1=m["greedy_1"])
    over_budget = tc.time_budget_s and time.perf_counter() - began > tc.time_budget_s
    if manager.should_save(step) or step == tc.steps or over_budget:
      manager.save(step, {"heads": heads, "opt_state": opt_state, "step": step}, force=True)
      atomic.write_json_atomic(workdir / "metrics.json", {"train_mtp": metrics})
    if over_budget:
      log(f"time budget of {tc.time_budget_s:.0f}s reached at step {step}: stopping")
      break
  manager.close()

  metrics["steps_done"] = step
  metrics["teacher_forced"] = evaluate(graphdef, heads, rest, val_tokens, tc)
  model = Model.from_module(nnx.merge(graphdef, heads, rest), tokenizer)
  model.save(workdir / "model")
  atomic.write_json_atomic(workdir / "metrics.json", {"train_mtp": metrics})
  return model, metrics


def decoding_acceptance(
  model: Model, *, num_draft: int = 4, n_prompts: int = 8, max_new_tokens: int = 96
) -> dict[str, Any]:
  """Acceptance by depth measured by speculative decoding of held-out code prompts."""
  import moespec_jax as msj
  from moespec_jax.data import corpus

  prompts = corpus.held_out_prompts(n_prompts, prompt_bytes=192, seed=1)
  out = {}
  for name, sampling in (("greedy", msj.SamplingParams()), ("t1", msj.SamplingParams(temperature=1.0))):
    res = msj.generate(
      model,
      prompts,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      spec=msj.SpecParams(drafter="mtp", num_draft=num_draft),
    )
    out[name] = {
      "acceptance_by_depth": res.stats["acceptance_by_depth"],
      "mean_accepted_length": res.stats["mean_accepted_length"],
    }
  return out


def draft_cost(model: Model, *, num_draft: int = 4, max_new_tokens: int = 64, repeats: int = 7) -> dict[str, Any]:
  """What a draft step of `model`'s heads costs against a plain pass of its target, batch 1, on
  one held-out prompt (`decoding.loop.draft_step_ms`: the controlled drafter's passes timed with and
  without the heads' draft computation)."""
  from moespec_jax.data import corpus
  from moespec_jax.decoding import loop

  prompts = corpus.held_out_prompts(1, prompt_bytes=192, seed=1)
  plain_ms, draft_ms_K = loop.draft_step_ms(
    model, prompts, max_new_tokens=max_new_tokens, num_draft=num_draft, repeats=repeats
  )
  return {
    "plain_pass_ms": plain_ms,
    "draft_ms_by_k": [float(x) for x in draft_ms_K],
    "draft_over_plain_pass_by_k": [float(x / plain_ms) for x in draft_ms_K],
  }


def plot_mtp(metrics: dict[str, Any], path: atomic.PathLike) -> pathlib.Path:
  """The training loss over steps, and the acceptance by depth: teacher-forced on held-out text
  (greedy; expected at T = 1) and, where measured, by speculative decoding (`decoding_acceptance`)."""
  plt = plots.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  curve = metrics["train_curve"]
  ax1.plot([r["step"] for r in curve], [r["loss"] for r in curve], "-", label=f"{metrics['train_config']['loss']} loss")
  plots.finish_axes(ax1, "step", "loss (nats)", "MTP heads on the frozen target")
  tf = metrics.get("teacher_forced", [])
  depths = [r["depth"] for r in tf]
  ax2.plot(depths, [r["greedy_acceptance"] for r in tf], "o-", label="teacher-forced, greedy")
  ax2.plot(depths, [r["expected_acceptance_t1"] for r in tf], "s--", label="teacher-forced, expected at T=1")
  for name, d in metrics.get("decoding", {}).items():
    acc = d["acceptance_by_depth"]
    ax2.plot(range(1, len(acc) + 1), acc, "^:", label=f"decoding ({name})")
  ax2.set_ylim(0.0, 1.05)
  plots.finish_axes(ax2, "draft depth", "acceptance", "acceptance by depth", legend_fontsize=8)
  return plots.save(fig, path)
