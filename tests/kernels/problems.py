"""Expert-FFN test problems shared by the kernel tests: random tokens, routing and expert weights,
and a check against the f32 XLA reference.

Tolerances (max abs error against the f32 XLA reference, outputs of order 1): f32 1e-4;
bf16 inputs and weights 5e-2 (bf16 rounding of h and of the products).
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import expert_ffn_reference

D, F = 32, 64
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 5e-2}

CASES = {
  # name: (n_tokens, n_experts, top_k, routing)
  "unused_expert_n_not_block_multiple": (5, 8, 2, "skip_last"),
  "all_on_one_expert": (4, 8, 2, "one"),
  "n1": (1, 8, 2, "random"),
  "top1": (3, 4, 1, "random"),
  "top8": (2, 16, 8, "random"),
}


def problem(n_tokens, n_experts, top_k, routing, dtype=jnp.float32, seed=0, d_model=D, hidden=F):
  k = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(k[0], (n_tokens, d_model))
  if routing == "one":
    ids = jnp.stack(
      [jnp.zeros((n_tokens,), jnp.int32)] + [jnp.full((n_tokens,), j, jnp.int32) for j in range(1, top_k)], axis=1
    )
    ids = ids.at[:, 0].set(3)  # every token chooses expert 3 (and the same others)
  else:
    hi = n_experts - 1 if routing == "skip_last" else n_experts
    ids = jax.vmap(lambda kk: jax.random.choice(kk, hi, (top_k,), replace=False))(
      jax.random.split(k[1], n_tokens)
    ).astype(jnp.int32)
  g = jax.nn.softmax(jax.random.normal(k[2], (n_tokens, top_k)), axis=-1)
  w = (
    jax.random.normal(k[3], (n_experts, d_model, hidden)) / np.sqrt(d_model),
    jax.random.normal(k[4], (n_experts, d_model, hidden)) / np.sqrt(d_model),
    jax.random.normal(k[5], (n_experts, hidden, d_model)) / np.sqrt(hidden),
  )
  return (x.astype(dtype), ids, g.astype(dtype), *(a.astype(dtype) for a in w))


def check(fn, case, dtype=jnp.float32):
  args = problem(*CASES[case], dtype=dtype)
  ref = expert_ffn_reference(*(a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in args))
  y = fn(*args)
  assert y.dtype == dtype and y.shape == ref.shape
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=TOL[dtype], rtol=0)
