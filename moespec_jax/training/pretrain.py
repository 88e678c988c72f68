"""Target pretraining on the embedded corpus: AdamW + warmup/cosine, clipping, load balancing,
validation bits per byte, orbax checkpoints with resume, progress output, metrics and a plot."""

from __future__ import annotations

import dataclasses
import math
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
from moespec_jax.config import ModelConfig, dataclass_from_dict
from moespec_jax.data import batches as batches_lib
from moespec_jax.data import tokenizer as tokenizer_lib
from moespec_jax.io import atomic, checkpoint, plots
from moespec_jax.io.progress import Progress
from moespec_jax.model import Transformer
from moespec_jax.model.moe import RouterBias
from moespec_jax.training import losses

if TYPE_CHECKING:
  import ml_collections


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  seed: int = 0
  batch_size: int = 16
  seq_len: int = 256
  steps: int = 1500
  learning_rate: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 100
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  b1: float = 0.9
  b2: float = 0.95
  aux_loss_weight: float = 0.01
  bias_update_rate: float = 1e-3
  eval_every: int = 250
  eval_batches: int = 16
  checkpoint_every: int = 250
  log_every_seconds: float = 10.0

  def __post_init__(self) -> None:
    for name in ("batch_size", "seq_len", "steps", "eval_every", "checkpoint_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
    if self.learning_rate <= 0:
      raise ValueError(f"train.learning_rate must be > 0, got {self.learning_rate}")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any] | ml_collections.ConfigDict) -> TrainConfig:
    return dataclass_from_dict(cls, d, "unknown train config fields")


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  warmup = min(tc.warmup_steps, tc.steps - 1)
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=tc.learning_rate,
    warmup_steps=warmup,
    decay_steps=max(tc.steps, warmup + 1),
    end_value=tc.learning_rate * tc.min_lr_ratio,
  )
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
    optax.clip_by_global_norm(tc.grad_clip),
    optax.adamw(schedule, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask),
  )


def split_module(module: Transformer) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, params, router biases): the trained params apart from non-gradient state."""
  return nnx.split(module, nnx.Param, RouterBias)


def make_train_step(
  graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, tc: TrainConfig, config: ModelConfig
) -> Callable[..., tuple[nnx.State, nnx.State, optax.OptState, dict[str, jax.Array]]]:
  """A jitted step: (params, biases, opt_state, batch) -> (params, biases, opt_state, metrics)."""

  def loss_fn(params: nnx.State, biases: nnx.State, batch_BT1: jax.Array):
    module = nnx.merge(graphdef, params, biases)
    inputs, targets = batch_BT1[:, :-1], batch_BT1[:, 1:]
    out = module(inputs)
    ce = jnp.mean(losses.cross_entropy(out.logits, targets))
    aux = jnp.float32(0.0)
    if out.routing is not None:
      aux = losses.load_balance_loss(out.routing.expert_ids, out.routing.probs)
    return ce + tc.aux_loss_weight * aux, (ce, aux, out.routing)

  @jax.jit
  def step(params: nnx.State, biases: nnx.State, opt_state: optax.OptState, batch_BT1: jax.Array):
    (loss, (ce, aux, routing)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, biases, batch_BT1)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, "ce": ce, "aux": aux, "grad_norm": optax.tree.norm(grads)}
    if routing is not None:
      load_LE = losses.expert_load(routing.expert_ids, config.n_routed_experts)
      metrics["max_expert_load"] = jnp.max(load_LE) * config.n_routed_experts
      if config.use_score_bias:
        # DeepSeek-V3's auxiliary-loss-free balancing: push under-loaded experts up.
        mean_load = 1.0 / config.n_routed_experts
        moe_biases = [b for b in jax.tree.leaves(biases)]
        new = [b + tc.bias_update_rate * jnp.sign(mean_load - load_LE[i]) for i, b in enumerate(moe_biases)]
        biases = jax.tree.unflatten(jax.tree.structure(biases), new)
    return params, biases, opt_state, metrics

  return step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[nnx.State, nnx.State, jax.Array], jax.Array]:
  @jax.jit
  def eval_step(params: nnx.State, biases: nnx.State, batch_BT1: jax.Array):
    module = nnx.merge(graphdef, params, biases)
    out = module(batch_BT1[:, :-1])
    return jnp.sum(losses.cross_entropy(out.logits, batch_BT1[:, 1:]))

  return eval_step


def evaluate(
  eval_step: Callable[[nnx.State, nnx.State, jax.Array], jax.Array],
  params: nnx.State,
  biases: nnx.State,
  val_tokens: np.ndarray,
  tc: TrainConfig,
  byte_lengths: np.ndarray,
  whole_split: bool = False,
) -> float:
  """Validation bits per byte over `eval_batches` batches spread over the split (the curve's
  points), or over the whole split (`whole_split`: the same bytes whatever the tokenizer, the
  figure that compares tokenizers)."""
  nats, n_bytes = 0.0, 0
  max_batches = None if whole_split else tc.eval_batches
  for vb in batches_lib.validation_batches(
    val_tokens, tc.batch_size, tc.seq_len, max_batches=max_batches, byte_lengths=byte_lengths
  ):
    nats += float(eval_step(params, biases, jnp.asarray(vb.tokens)))
    n_bytes += vb.n_bytes
  return tokenizer_lib.bits_per_byte(nats, n_bytes)


def plot_curves(metrics: dict, path: pathlib.Path) -> None:
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(7, 4))
  tr = metrics["train_curve"]
  if tr:
    ax.plot([r["step"] for r in tr], [r["ce"] / math.log(2) for r in tr], label="train (bits/token)")
  va = metrics["val_curve"]
  if va:
    label = f"validation, {metrics['train_config']['eval_batches']} batches spread over the split (bits/byte)"
    ax.plot([r["step"] for r in va], [r["bits_per_byte"] for r in va], "o-", label=label)
  if "final_val_bits_per_byte" in metrics and tr:
    ax.plot([tr[-1]["step"]], [metrics["final_val_bits_per_byte"]], "s", label="validation, whole split (bits/byte)")
  plots.finish_axes(ax, "step", "bits", f"pretraining: {metrics.get('config_name', '')}")
  plots.save(fig, path)


def train(
  config: ModelConfig,
  tc: TrainConfig,
  workdir: atomic.PathLike,
  *,
  config_name: str = "",
  log: Callable[[str], None] = print,
) -> tuple[Model, dict[str, Any]]:
  """Trains (or resumes) a target model in `workdir`; returns the model and its metrics.

  `workdir/checkpoints` holds resumable state; `workdir/model` the final model;
  `workdir/metrics.json` and `workdir/loss.png` the curves.
  """
  workdir = pathlib.Path(workdir)
  tokenizer = tokenizer_lib.load_tokenizer(config.tokenizer)
  if tokenizer.vocab_size > config.vocab_size:
    raise ValueError(
      f"tokenizer {config.tokenizer!r} needs vocab_size >= {tokenizer.vocab_size}, config has {config.vocab_size}"
    )
  if (config.eos_id, config.bos_id) != (tokenizer.eos_id, tokenizer.bos_id):
    raise ValueError(
      f"tokenizer {config.tokenizer!r} has eos_id {tokenizer.eos_id} and bos_id {tokenizer.bos_id}, the config "
      f"{config.eos_id} and {config.bos_id}: set model.eos_id and model.bos_id to the tokenizer's"
    )
  if tc.seq_len > config.max_seq_len:
    raise ValueError(f"train.seq_len ({tc.seq_len}) exceeds model max_seq_len ({config.max_seq_len})")
  workdir.mkdir(parents=True, exist_ok=True)
  log(f"tokenizing the corpus ({tokenizer!r}) ...")
  train_tokens = batches_lib.corpus_tokens(tokenizer, "train")
  val_tokens = batches_lib.corpus_tokens(tokenizer, "validation")
  byte_lengths = tokenizer.token_byte_lengths()
  log(f"corpus: {train_tokens.size:,} train tokens, {val_tokens.size:,} validation tokens")

  module = Transformer(config, rngs=nnx.Rngs(tc.seed))
  graphdef, params, biases = split_module(module)
  optimizer = make_optimizer(tc)
  opt_state = optimizer.init(params)
  state = {"params": params, "biases": biases, "opt_state": opt_state, "step": 0}
  metrics: dict[str, Any] = {
    "config_name": config_name,
    "model_config": config.to_dict(),
    "train_config": dataclasses.asdict(tc),
    "params": config.param_counts(),
    "train_curve": [],
    "val_curve": [],
  }

  manager = checkpoint.CheckpointManager(
    workdir / "checkpoints", max_to_keep=2, save_interval_steps=tc.checkpoint_every
  )
  start = 0
  if manager.latest_step() is not None:
    start = manager.latest_step()
    state = manager.restore(start, checkpoint.abstract_tree(state))
    prev = workdir / "metrics.json"
    if prev.exists():
      import json

      old = json.loads(prev.read_text())
      metrics["train_curve"] = [r for r in old.get("train_curve", []) if r["step"] <= start]
      metrics["val_curve"] = [r for r in old.get("val_curve", []) if r["step"] <= start]
    log(f"resuming from step {start}")
  params, biases, opt_state = state["params"], state["biases"], state["opt_state"]

  train_step = make_train_step(graphdef, optimizer, tc, config)
  eval_step = make_eval_step(graphdef)
  tokens_per_step = tc.batch_size * tc.seq_len
  progress = Progress(tc.steps, desc="train", unit="tokens", every_s=tc.log_every_seconds, start_step=start, emit=log)
  step_times = []
  step = start
  for step in range(start + 1, tc.steps + 1):
    batch = jnp.asarray(batches_lib.train_batch(train_tokens, tc.batch_size, tc.seq_len, tc.seed, step))
    t0 = time.perf_counter()
    params, biases, opt_state, m = train_step(params, biases, opt_state, batch)
    m = {k: float(v) for k, v in m.items()}
    dt = time.perf_counter() - t0
    if step > start + 1:
      step_times.append(dt)
    if not math.isfinite(m["loss"]):
      raise FloatingPointError(f"loss is {m['loss']} at step {step}")
    if step % 10 == 0 or step == tc.steps:
      metrics["train_curve"].append({"step": step, **m})
    progress.update(step, tokens_per_step, loss=m["ce"])
    if step % tc.eval_every == 0 or step == tc.steps:
      bpb = evaluate(eval_step, params, biases, val_tokens, tc, byte_lengths)
      metrics["val_curve"].append({"step": step, "bits_per_byte": bpb})
      log(f"step {step}: validation {bpb:.4f} bits/byte ({tc.eval_batches} batches spread over the split)")
    if manager.should_save(step) or step == tc.steps:
      manager.save(step, {"params": params, "biases": biases, "opt_state": opt_state, "step": step}, force=True)
      atomic.write_json_atomic(workdir / "metrics.json", metrics)
  manager.close()

  if step_times:
    metrics["train_tokens_per_second"] = tokens_per_step / float(np.median(step_times))
  if not metrics["val_curve"] or metrics["val_curve"][-1]["step"] != tc.steps:
    bpb = evaluate(eval_step, params, biases, val_tokens, tc, byte_lengths)
    metrics["val_curve"].append({"step": tc.steps, "bits_per_byte": bpb})
  # The final figure over the whole split: the curve's sampled batches cover different text for
  # tokenizers of different lengths.
  metrics["final_val_bits_per_byte"] = evaluate(eval_step, params, biases, val_tokens, tc, byte_lengths, True)
  log(f"step {step}: validation over the whole split {metrics['final_val_bits_per_byte']:.4f} bits/byte")
  model = Model.from_module(nnx.merge(graphdef, params, biases), tokenizer)
  model.save(workdir / "model")
  atomic.write_json_atomic(workdir / "metrics.json", metrics)
  plot_curves(metrics, workdir / "loss.png")
  return model, metrics


def validation_bits_per_byte(
  model: Model, *, batch_size: int = 8, seq_len: int = 256, max_batches: int | None = 8
) -> float:
  """Bits per byte of `model` on `max_batches` batches of validation windows spread over the split
  (None: the whole split)."""
  graphdef, params, biases = split_module(model.module())
  tc = TrainConfig(batch_size=batch_size, seq_len=min(seq_len, model.config.max_seq_len), eval_batches=max_batches)
  val_tokens = batches_lib.corpus_tokens(model.tokenizer, "validation")
  return evaluate(make_eval_step(graphdef), params, biases, val_tokens, tc, model.tokenizer.token_byte_lengths())
