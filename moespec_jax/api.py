"""`Model`: the public handle on a target model (config, parameters, tokenizer)."""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx
from jax.sharding import Mesh

from moespec_jax.config import ModelConfig
from moespec_jax.data import batches as batches_lib
from moespec_jax.data import tokenizer as tokenizer_lib
from moespec_jax.data.tokenizer import Tokenizer
from moespec_jax.io import atomic, checkpoint
from moespec_jax.model import ForwardOutput, Kernels, PackedWeights, Transformer, pack_weights
from moespec_jax.model import expert_table as expert_table_lib
from moespec_jax.parallel import mesh as mesh_lib
from moespec_jax.parallel import placement
from pallas_kernels.expert_parallel import ExpertSharding
from pallas_kernels.policy import KernelPolicy

FORMAT = "moespec_jax"
FORMAT_VERSION = 1
# The default expert table (`Model.expert_table`): windows of the corpus's train split.
EXPERT_TABLE_WINDOWS = 128
EXPERT_TABLE_LENGTH = 256


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("policy",))
def _forward(graphdef: nnx.GraphDef, state: nnx.State, tokens_BT: jax.Array, *, policy: KernelPolicy) -> ForwardOutput:
  return nnx.merge(graphdef, state)(tokens_BT, kernels=Kernels(policy))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("head", "dense"))
def _pack(graphdef: nnx.GraphDef, state: nnx.State, *, head: bool, dense: bool) -> PackedWeights:
  return pack_weights(nnx.merge(graphdef, state), head=head, dense=dense)


def _from_leaves(cached: tuple[list[jax.Array], Any] | None, leaves: list[jax.Array]) -> bool:
  """Whether a (parameter arrays, value) pair was derived from these very parameter arrays."""
  return cached is not None and len(cached[0]) == len(leaves) and all(a is b for a, b in zip(cached[0], leaves))


class Model:
  """A target MoE model (and its MTP heads once trained) with its tokenizer.

  The NNX module is kept split as (graphdef, state) so that jitted programs take the
  parameters as an explicit pytree.
  """

  def __init__(
    self,
    config: ModelConfig,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokenizer: Tokenizer,
    mesh: Mesh | None = None,
  ) -> None:
    self.config = config
    self.graphdef = graphdef
    self.state = state
    self.tokenizer = tokenizer
    # The device mesh the parameters live on (`moespec_jax.parallel.mesh`), None: one device.
    self.mesh = mesh
    # Hugging Face import only: {"spec": ImportSpec}.
    self.hf_extras: dict[str, Any] = {}
    # (the parameter arrays they were packed from, {(head, dense): PackedWeights}): `packed_weights`.
    self._packed = None
    # (the parameter arrays it was counted from, the default ExpertTable): `expert_table`.
    self._expert_table = None

  # Construction -----------------------------------------------------------------------
  @classmethod
  def init(
    cls, config: ModelConfig, seed: int = 0, tokenizer: Tokenizer | None = None, *, mesh: Mesh | None = None
  ) -> Model:
    """A randomly initialised model. With `mesh` (`make_mesh`), its routed experts are sharded on
    the mesh's expert axis and the rest replicated, each device computing only its own share."""
    if not isinstance(config, ModelConfig):
      raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    tokenizer = tokenizer if tokenizer is not None else tokenizer_lib.load_tokenizer(config.tokenizer)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    shardings = None
    if mesh is not None:
      mesh_lib.check_model(config, mesh)
      shardings = mesh_lib.state_shardings(abstract, mesh)
    # Compiled with or without a mesh, so that both give the same bits (XLA folds the initialisers'
    # constants, so an eager init differs from a compiled one in some last bits).
    make = jax.jit(lambda: nnx.split(Transformer(config, rngs=nnx.Rngs(int(seed))))[1], out_shardings=shardings)
    return cls(config, graphdef, make(), tokenizer, mesh)

  def on_mesh(self, mesh: Mesh | None) -> Model:
    """This model with its parameters placed on `mesh` (`make_mesh`; None: on one device)."""
    if mesh is None:
      state = jax.device_put(self.state, jax.local_devices()[0])
    else:
      mesh_lib.check_model(self.config, mesh)
      state = mesh_lib.place(self.state, mesh)
    model = type(self)(self.config, self.graphdef, state, self.tokenizer, mesh)
    model.hf_extras = self.hf_extras
    return model

  @classmethod
  def from_module(cls, module: Transformer, tokenizer: Tokenizer) -> Model:
    graphdef, state = nnx.split(module)
    return cls(module.config, graphdef, state, tokenizer)

  def packed_weights(
    self, *, head: bool = True, dense: bool = True, leaves: list[jax.Array] | None = None
  ) -> PackedWeights:
    """The weights the C++ CPU products of decoding read (`model.pack_weights`: the output head
    where `head`, the dense projections where `dense`), packed once per parameter set and reused by
    every generate call until the parameters change. `leaves`: `jax.tree.leaves(self.state)`, where
    the caller has it already."""
    leaves = jax.tree.leaves(self.state) if leaves is None else leaves
    cached = self._packed
    if not _from_leaves(cached, leaves):
      cached = self._packed = (leaves, {})
    parts = cached[1]
    found = parts.get((head, dense))
    if found is None:
      if head and dense:  # each part packed once, whatever the order the parts are asked for in
        head_part = self.packed_weights(dense=False, leaves=leaves)
        dense_part = self.packed_weights(head=False, leaves=leaves)
        found = PackedWeights(head_NDC=head_part.head_NDC, layers=dense_part.layers, mtp=dense_part.mtp)
      elif head or dense:
        found = _pack(self.graphdef, self.state, head=head, dense=dense)
      else:
        found = PackedWeights()
      parts[(head, dense)] = found
    return found

  def module(self) -> Transformer:
    """A fresh NNX module holding this model's parameters (its own variables: changing them leaves
    this model as it is)."""
    return nnx.merge(self.graphdef, self.state, copy=True)

  def expert_table(self, tokens: npt.ArrayLike | None = None) -> expert_table_lib.ExpertTable:
    """Each token's predicted experts per MoE layer (`model.expert_table`: what expert-aware draft
    trees read), counted from the target's routing over `tokens` [rows, length], or by default over
    `EXPERT_TABLE_WINDOWS` windows of `EXPERT_TABLE_LENGTH` tokens of the corpus's train split
    (fixed offsets), counted once per parameter set."""
    if tokens is not None:
      return expert_table_lib.build(self.module(), self.validate_tokens(tokens))
    leaves = jax.tree.leaves(self.state)
    cached = self._expert_table
    if not _from_leaves(cached, leaves):
      train = batches_lib.corpus_tokens(self.tokenizer, "train")
      length = min(EXPERT_TABLE_LENGTH, self.config.max_seq_len, train.size)
      starts = np.random.default_rng(0).integers(0, train.size - length + 1, EXPERT_TABLE_WINDOWS)
      windows = np.stack([train[s : s + length] for s in starts])
      cached = self._expert_table = (leaves, expert_table_lib.build(self.module(), windows))
    return cached[1]

  # Persistence ------------------------------------------------------------------------
  def save(self, path: atomic.PathLike) -> pathlib.Path:
    """Writes config, tokenizer and parameters to `path` atomically (replacing it)."""
    path = pathlib.Path(path)
    with atomic.atomic_dir(path) as tmp:
      meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model_config": self.config.to_dict()}
      (tmp / "config.json").write_text(json.dumps(meta, indent=2))
      self.tokenizer.save(tmp / "tokenizer")
      checkpoint.save_pytree(tmp / "params", nnx.to_pure_dict(self.state))
    return path

  def save_hf(self, path: atomic.PathLike) -> pathlib.Path:
    """Writes a Hugging Face checkpoint in the Qwen2-MoE layout to `path` atomically (config.json,
    model.safetensors, the tokenizer and generation_config.json; transformers loads it, as does
    `load`): `AutoTokenizer`'s `tokenizer(text)` gives `self.tokenizer.prompt_ids(text)`, and BOS
    is the token those start with. ValueError for a layout Qwen2-MoE cannot express; MTP heads are
    not written (`moespec_jax.hf.export`)."""
    from moespec_jax.hf import export  # pylint: disable=g-import-not-at-top

    return export.export_qwen2_moe(self, path)

  @classmethod
  def load(cls, path: atomic.PathLike, dtype: str | None = None, *, mesh: Mesh | None = None) -> Model:
    """Loads a directory written by `save`, or a Hugging Face model directory.

    A Hugging Face directory (config.json with a `model_type`, safetensors weights) is
    imported by `moespec_jax.hf`; `dtype` ("float32" / "bfloat16") casts its weights
    (default: kept, float32 on CPU). `dtype` is for Hugging Face directories only.
    With `mesh` (`make_mesh`) the parameters are placed as `init` places them: a directory of
    `save` restores each device's shard from the checkpoint directly; a Hugging Face directory's
    tensors are placed as they are read (each device receives its share of the routed experts, the
    host holds one stacked weight at a time).
    """
    path = pathlib.Path(path).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
      raise FileNotFoundError(f"no model at {path}: {config_file} is missing")
    meta = atomic.read_json(config_file)
    if meta.get("format") != FORMAT:
      if "model_type" in meta:
        from moespec_jax import hf  # pylint: disable=g-import-not-at-top

        config, graphdef, state, tokenizer, extras = hf.load_checkpoint(path, dtype=dtype, mesh=mesh)
        model = cls(config, graphdef, state, tokenizer, mesh)
        model.hf_extras = extras
        return model
      raise ValueError(f"{config_file} is not a moespec_jax model config")
    if dtype is not None:
      raise ValueError("dtype is an option for Hugging Face directories only")
    config = ModelConfig.from_dict(meta["model_config"])
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    target = nnx.to_pure_dict(abstract_state)
    if mesh is not None:
      mesh_lib.check_model(config, mesh)
      target = mesh_lib.abstract_on_mesh(target, mesh)
    pure = checkpoint.load_pytree(path / "params", checkpoint.abstract_tree(target))
    nnx.replace_by_pure_dict(abstract_state, pure)
    tokenizer = tokenizer_lib.load_tokenizer(path / "tokenizer")
    return cls(config, graphdef, abstract_state, tokenizer, mesh)

  # Computation ------------------------------------------------------------------------
  def expert_method(self, kernel: str = "auto") -> str:
    """The expert-FFN method a `SpecParams.kernel` choice resolves to."""
    return self.config.expert_method if kernel == "auto" else kernel

  def validate_tokens(self, tokens: npt.ArrayLike) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] == 0 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"tokens must be a non-empty int array [B, T], got shape {tokens.shape} dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
      raise ValueError(f"tokens has ids outside the vocabulary [0, {self.config.vocab_size})")
    if tokens.shape[1] > self.config.max_seq_len:
      raise ValueError(f"tokens length {tokens.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
    return tokens.astype(np.int32)

  def forward_full(self, tokens: npt.ArrayLike, *, kernel: str = "auto") -> ForwardOutput:
    """Full-sequence forward without cache: logits, final hidden states and routing."""
    tokens = self.validate_tokens(tokens)
    policy = KernelPolicy(expert_method=self.expert_method(kernel), experts=self.expert_sharding())
    return _forward(self.graphdef, self.state, jnp.asarray(tokens), policy=policy)

  def forward(self, tokens: npt.ArrayLike, *, kernel: str = "auto") -> jax.Array:
    """tokens int [B, T] -> float32 logits [B, T, V]."""
    return self.forward_full(tokens, kernel=kernel).logits

  def renumber_experts(self, order: npt.ArrayLike) -> Model:
    """An equivalent model whose expert j of MoE layer l is this model's expert order[l, j]
    (`parallel.placement.renumber_experts`); on this model's mesh, rank r then holds the experts
    order[l, r E / R : (r + 1) E / R]: `placement.expert_order(rank_LE)` realises a placement."""
    module = self.module()
    placement.renumber_experts(module, np.asarray(order))
    graphdef, state = nnx.split(module)
    model = type(self)(self.config, graphdef, state, self.tokenizer)
    return model if self.mesh is None else model.on_mesh(self.mesh)

  def expert_sharding(self) -> ExpertSharding | None:
    """Where the routed experts run: the dispatch's view of the model's mesh (None: one device)."""
    return None if self.mesh is None else mesh_lib.expert_sharding(self.mesh)

  def param_counts(self) -> dict[str, Any]:
    return self.config.param_counts()
