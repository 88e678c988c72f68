"""The C++ CPU kernels (pallas_kernels.cpu): the expert FFN against the reference, its rows' bits
independent of the pass, the packed products, attention (GQA and MLA) against numpy, the clock."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import cpu
from pallas_kernels.reference import expert_ffn_reference
from tests.kernels.problems import CASES, check, problem


@pytest.fixture(scope="module")
def cpu_kernel():
  if not cpu.available():
    pytest.fail(f"C++ CPU kernel unavailable: {cpu.unavailable_reason()}")


@pytest.mark.parametrize("method", ["dedup", "per_slot"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernel(cpu_kernel, method, case):
  del cpu_kernel
  check(functools.partial(pallas_kernels.expert_ffn, method=method, backend="cpu"), case)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_cpu_kernel_uneven_shapes_and_threads(cpu_kernel, monkeypatch, threads):
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", threads)
  # Widths that are not multiples of the 16-float vectors (column tails); groups of 20 pairs on
  # rows of 7 vectors (token tiles of 6 and one of 2, over two register panels); F = 2100 is cut into two
  # units per expert at a column that is not a vector multiple (row tiles); fewer units than
  # threads (one token, top-1); groups of 2-8 pairs on rows wider than their tile's register
  # panel (the first token streams whole rows, the others read them from cache: the decoding
  # shape of the peer_bench checkpoints, D = 256 and F = 320).
  problems = [
    problem(13, 4, 2, "random", d_model=40, hidden=200),
    problem(20, 3, 3, "random", d_model=24, hidden=120),
    problem(8, 2, 2, "random", d_model=256, hidden=320),
    problem(5, 4, 2, "random", d_model=256, hidden=320),
    problem(3, 4, 2, "random", d_model=32, hidden=2100),
    problem(1, 4, 1, "random", d_model=16, hidden=48),
  ]
  for args in problems:
    ref = expert_ffn_reference(*args)
    for method in ("dedup", "per_slot"):
      np.testing.assert_allclose(cpu.expert_ffn_cpu(*args, method=method), ref, atol=1e-4)


@pytest.mark.parametrize("method", ["dedup", "per_slot"])
def test_cpu_kernel_token_results_do_not_depend_on_the_pass(cpu_kernel, monkeypatch, method):
  """A token's output is the same bits alone (a plain step) and among a pass's tokens (a
  verification pass, a batch): experts shared by several tokens, rows wider than a register
  panel (F = 320), wider than a single-token panel (F = 500: row tiles for every token count),
  experts cut into column units (F = 2100), on two threads."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", "2")
  for t_, e, k, d, f in ((5, 32, 4, 256, 128), (8, 16, 2, 256, 320), (9, 4, 2, 40, 500), (5, 8, 2, 64, 2100)):
    x, ids, g, wg, wu, wd = problem(t_, e, k, "random", d_model=d, hidden=f, seed=t_)
    together = np.asarray(cpu.expert_ffn_cpu(x, ids, g, wg, wu, wd, method=method))
    for t in range(t_):
      alone = cpu.expert_ffn_cpu(x[t : t + 1], ids[t : t + 1], g[t : t + 1], wg, wu, wd, method=method)
      np.testing.assert_array_equal(np.asarray(alone), together[t : t + 1], err_msg=f"token {t} of {t_}, F={f}")


def test_cpu_kernel_long_passes_sum_per_slot(cpu_kernel, monkeypatch):
  """Past the kept pair outputs' size (long prefills) the kernel sums one output per thread
  slot: still the reference's result, and the same bits from call to call."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_PAIR_OUTPUT_BYTES", "0")
  monkeypatch.setenv("MOESPEC_FFI_THREADS", "2")
  for args in (
    problem(20, 3, 3, "random", d_model=24, hidden=120),
    problem(5, 8, 2, "random", d_model=64, hidden=2100),
  ):
    ref = expert_ffn_reference(*args)
    for method in ("dedup", "per_slot"):
      first = np.asarray(cpu.expert_ffn_cpu(*args, method=method))
      np.testing.assert_allclose(first, ref, atol=1e-4)
      np.testing.assert_array_equal(np.asarray(cpu.expert_ffn_cpu(*args, method=method)), first)


def test_cpu_kernel_activation_matches_at_large_magnitudes(cpu_kernel):
  del cpu_kernel
  # The C++ SwiGLU's own exp: gate pre-activations of either sign up to ~100s (sigmoid saturated
  # at 0 and 1, exp(-|g|) below the normal floats), an activation count that is not a multiple
  # of 16 (the one-lane tail).
  x, ids, g, wg, wu, wd = problem(7, 4, 2, "random", d_model=24, hidden=40)
  x = x * 60.0
  ref = np.asarray(expert_ffn_reference(x, ids, g, wg, wu, wd))
  assert np.abs(np.einsum("td,tkdf->tkf", x, wg[ids])).max() > 100.0
  for method in ("dedup", "per_slot"):
    y = np.asarray(cpu.expert_ffn_cpu(x, ids, g, wg, wu, wd, method=method))
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_cpu_kernel_is_deterministic_across_threads(cpu_kernel, monkeypatch):
  del cpu_kernel
  # Whichever thread runs which expert, the experts' outputs are summed in one order.
  monkeypatch.setenv("MOESPEC_FFI_THREADS", "2")
  args = problem(32, 16, 4, "random", d_model=64, hidden=64)
  fn = jax.jit(functools.partial(cpu.expert_ffn_cpu, method="dedup"))
  first = np.asarray(fn(*args))
  for _ in range(50):
    np.testing.assert_array_equal(np.asarray(fn(*args)), first)


def test_cpu_kernel_gradients_match_reference(cpu_kernel):
  del cpu_kernel
  x, ids, g, wg, wu, wd = problem(6, 8, 2, "skip_last")

  def loss(fn):
    return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(a[0], ids, *a[1:]))), argnums=(0, 1, 2, 3, 4))

  ref = loss(expert_ffn_reference)(x, g, wg, wu, wd)
  got = loss(functools.partial(pallas_kernels.expert_ffn, method="dedup", backend="cpu"))(x, g, wg, wu, wd)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_packed_matmul_matches_numpy(cpu_kernel, monkeypatch, threads):
  """The output head's and the dense projections' product: any rows, widths that are not
  multiples of the block or of the 16-float vectors (padding dropped), fewer blocks than threads."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", threads)
  rng = np.random.default_rng(0)
  for d, v, block in ((64, 300, 256), (40, 513, 256), (32, 16, 256), (24, 100, 48), (48, 200, 64), (32, 40, 64)):
    w_DV = rng.normal(size=(d, v)).astype(np.float32)
    w_NDC = cpu.pack_columns(jnp.asarray(w_DV), block)
    assert w_NDC.shape == (-(-v // block), d, block)
    for m in (0, 1, 3, 8, 9, 17):
      x_MD = rng.normal(size=(m, d)).astype(np.float32)
      got = np.asarray(cpu.packed_matmul(jnp.asarray(x_MD), w_NDC, v))
      assert got.shape == (m, v)
      np.testing.assert_allclose(got, x_MD.astype(np.float64) @ w_DV, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("block", [cpu.PACK_COLUMNS, 256])
def test_packed_matmul_rows_do_not_depend_on_the_pass(cpu_kernel, block):
  """A row's product is the same bits whether it is multiplied alone (a plain step) or among
  the rows of a verification pass, for the blocks decoding packs and for wider ones."""
  del cpu_kernel
  rng = np.random.default_rng(1)
  w_NDC = cpu.pack_columns(jnp.asarray(rng.normal(size=(256, 1024)), jnp.float32), block)
  x_MD = jnp.asarray(rng.normal(size=(18, 256)), jnp.float32)
  together = np.asarray(cpu.packed_matmul(x_MD, w_NDC))
  for m in (0, 5, 17):
    np.testing.assert_array_equal(np.asarray(cpu.packed_matmul(x_MD[m : m + 1], w_NDC)), together[m : m + 1])


@pytest.mark.parametrize("threads", ["1", "3"])
def test_packed_matmul_side_by_side(cpu_kernel, monkeypatch, threads):
  """G products at once (x [G, M, D], W [G, N, D, C]: MLA's per-head up-projections): each the
  one-product result, bit for bit, and numpy's; any rows, fewer blocks than threads."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", threads)
  rng = np.random.default_rng(4)
  g, d, v = 3, 24, 100
  w_GDV = rng.normal(size=(g, d, v)).astype(np.float32)
  w_GNDC = jax.vmap(cpu.pack_columns)(jnp.asarray(w_GDV))
  for m in (1, 5, 9):
    x_GMD = rng.normal(size=(g, m, d)).astype(np.float32)
    got = np.asarray(cpu.packed_matmul(jnp.asarray(x_GMD), w_GNDC, v))
    assert got.shape == (g, m, v)
    np.testing.assert_allclose(got, np.einsum("gmd,gdv->gmv", x_GMD.astype(np.float64), w_GDV), rtol=1e-5, atol=1e-4)
    for i in range(g):
      np.testing.assert_array_equal(got[i], np.asarray(cpu.packed_matmul(jnp.asarray(x_GMD[i]), w_GNDC[i], v)))


def test_packed_matmul_rejects_bad_shapes(cpu_kernel):
  del cpu_kernel
  with pytest.raises(ValueError, match="x \\[M, D\\] and W \\[N, D, C\\]"):
    cpu.packed_matmul(jnp.zeros((2, 8)), jnp.zeros((1, 4, 16)))
  with pytest.raises(ValueError, match="x \\[G, M, D\\] and W \\[G, N, D, C\\]"):
    cpu.packed_matmul(jnp.zeros((3, 2, 4)), jnp.zeros((2, 1, 4, 16)))
  with pytest.raises(ValueError, match="\\[D, V\\] weight"):
    cpu.pack_columns(jnp.zeros((2, 3, 4)))


def _attention_reference(q_NQD, keys_NDS, values_NSD, limit_NQ):
  scores_NQS = np.einsum("nqd,nds->nqs", q_NQD.astype(np.float64), keys_NDS)
  visible_NQS = np.arange(keys_NDS.shape[2]) <= limit_NQ[..., None]
  scores_NQS = np.where(visible_NQS, scores_NQS, -np.inf)
  top_NQ1 = scores_NQS.max(-1, keepdims=True)
  probs_NQS = np.where(visible_NQS, np.exp(scores_NQS - np.where(np.isfinite(top_NQ1), top_NQ1, 0.0)), 0.0)
  total_NQ1 = probs_NQS.sum(-1, keepdims=True)
  probs_NQS = probs_NQS / np.where(total_NQ1 > 0, total_NQ1, 1.0)
  return np.einsum("nqs,nsd->nqd", probs_NQS, values_NSD)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_cached_attention_matches_numpy(cpu_kernel, monkeypatch, threads):
  """Ragged limits (none visible, some, past the cache's end), query rows that are not a
  multiple of the panels, widths that are not multiples of 16 floats, scores far apart (the
  exponential's range), fewer pairs than threads."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", threads)
  rng = np.random.default_rng(0)
  for n, q, d, s, spread in ((32, 2, 32, 256, 1.0), (4, 18, 64, 100, 1.0), (3, 5, 24, 37, 8.0), (1, 1, 16, 1, 1.0)):
    q_NQD = (spread * rng.normal(size=(n, q, d))).astype(np.float32)
    keys_NDS = rng.normal(size=(n, d, s)).astype(np.float32)
    values_NSD = rng.normal(size=(n, s, d)).astype(np.float32)
    limit_NQ = rng.integers(-1, s + 3, size=(n, q)).astype(np.int32)
    got = np.asarray(cpu.cached_attention(*map(jnp.asarray, (q_NQD, keys_NDS, values_NSD, limit_NQ))))
    np.testing.assert_allclose(got, _attention_reference(q_NQD, keys_NDS, values_NSD, limit_NQ), atol=2e-5)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_tree_attention_masks_its_window_and_sees_every_earlier_position(cpu_kernel, monkeypatch, threads):
  """Draft trees' passes: positions before each row's window are seen up to its limit, positions
  in the window only where its mask is set (windows of 1 to 128 positions, straddling 32-bit
  words; a row whose window masks everything past base). Masked positions weigh exactly 0: other
  keys and values there change no bit."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", threads)
  rng = np.random.default_rng(5)
  for n, q, d, s, m in ((4, 6, 32, 300, 9), (2, 17, 24, 200, 128), (3, 1, 16, 40, 1), (2, 5, 64, 160, 70)):
    q_NQD = rng.normal(size=(n, q, d)).astype(np.float32)
    keys_NDS = rng.normal(size=(n, d, s)).astype(np.float32)
    values_NSD = rng.normal(size=(n, s, d)).astype(np.float32)
    base_NQ = rng.integers(0, s - m + 1, size=(n, q)).astype(np.int32)
    limit_NQ = (base_NQ + rng.integers(-1, m, size=(n, q))).astype(np.int32)
    window_NQM = rng.random((n, q, m)) < 0.5
    window_NQM[0, 0] = False
    slot_S = np.arange(s)
    rel_NQS = slot_S - base_NQ[..., None]
    in_window_NQS = (rel_NQS >= 0) & (rel_NQS < m)
    seen_NQS = np.take_along_axis(window_NQM, np.clip(rel_NQS, 0, m - 1), axis=2)
    visible_NQS = (slot_S <= limit_NQ[..., None]) & (~in_window_NQS | seen_NQS)
    # The reference: cached attention with masked positions' scores at -inf.
    keys_masked = np.where(visible_NQS[:, :, None, :], keys_NDS[:, None], 0.0)
    scores_NQS = np.einsum("nqd,nqds->nqs", q_NQD.astype(np.float64), keys_masked)
    scores_NQS = np.where(visible_NQS, scores_NQS, -np.inf)
    top = scores_NQS.max(-1, keepdims=True)
    probs = np.where(visible_NQS, np.exp(scores_NQS - np.where(np.isfinite(top), top, 0.0)), 0.0)
    probs /= np.where(probs.sum(-1, keepdims=True) > 0, probs.sum(-1, keepdims=True), 1.0)
    want = np.einsum("nqs,nsd->nqd", probs, values_NSD)
    args = tuple(map(jnp.asarray, (q_NQD, keys_NDS, values_NSD, limit_NQ, base_NQ, window_NQM)))
    got = np.asarray(cpu.tree_attention(*args))
    np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"{(n, q, d, s, m)}")
    if m == 9:  # positions no row of a pair sees: other entries there change no bit
      for pair, slot in np.argwhere(~visible_NQS.any(axis=1)):
        keys_NDS[pair, :, slot], values_NSD[pair, slot] = 1e3, -1e3
      args = tuple(map(jnp.asarray, (q_NQD, keys_NDS, values_NSD, limit_NQ, base_NQ, window_NQM)))
      np.testing.assert_array_equal(np.asarray(cpu.tree_attention(*args)), got)
  with pytest.raises(ValueError, match="tree_attention needs"):
    cpu.tree_attention(*args[:5], jnp.ones((*args[3].shape, 129), bool))


@pytest.mark.parametrize("first", [500, 200])
def test_cached_attention_rows_do_not_depend_on_the_pass(cpu_kernel, first):
  """A query row's output is the same bits alone (a plain step) or among a verification
  pass's rows, every row; and the cache past the last visible position is never read. A row
  alone and in the pass scores different numbers of keys, so some of its keys fall in a register
  panel in one and in the column tail in the other (both fused multiply-adds)."""
  del cpu_kernel
  rng = np.random.default_rng(2)
  q_NQD = jnp.asarray(rng.normal(size=(2, 18, 32)), jnp.float32)
  keys_NDS = rng.normal(size=(2, 32, 600)).astype(np.float32)
  values_NSD = rng.normal(size=(2, 600, 32)).astype(np.float32)
  limit_NQ = jnp.asarray(np.broadcast_to(np.arange(first, first + 18)[None], (2, 18)), jnp.int32)
  together = np.asarray(cpu.cached_attention(q_NQD, keys_NDS, values_NSD, limit_NQ))
  for i in range(18):
    alone = cpu.cached_attention(q_NQD[:, i : i + 1], keys_NDS, values_NSD, limit_NQ[:, i : i + 1])
    np.testing.assert_array_equal(np.asarray(alone), together[:, i : i + 1])
  keys_NDS[:, :, first + 18 :] = np.nan
  values_NSD[:, first + 18 :] = np.nan
  np.testing.assert_array_equal(np.asarray(cpu.cached_attention(q_NQD, keys_NDS, values_NSD, limit_NQ)), together)
  with pytest.raises(ValueError, match="cached_attention needs"):
    cpu.cached_attention(q_NQD, keys_NDS[:, :16], values_NSD, limit_NQ)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_cached_attention_prefill_blocks(cpu_kernel, monkeypatch, threads):
  """A prefill's rows (t-major, 2 query heads per KV head, each seeing its own position) run in
  causal blocks, one pair's blocks dealt to 1 or 2 threads: each row the same bits as alone, the
  reference's values, and nothing past the last row's position read (NaN there changes nothing)."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", threads)
  rng = np.random.default_rng(3)
  n, t, r, d, s = 1, 150, 2, 32, 160
  q_NQD = rng.normal(size=(n, t * r, d)).astype(np.float32)
  keys_NDS = rng.normal(size=(n, d, s)).astype(np.float32)
  values_NSD = rng.normal(size=(n, s, d)).astype(np.float32)
  limit_NQ = np.repeat(np.arange(t, dtype=np.int32), r)[None]
  together = np.asarray(cpu.cached_attention(*map(jnp.asarray, (q_NQD, keys_NDS, values_NSD, limit_NQ))))
  np.testing.assert_allclose(together, _attention_reference(q_NQD, keys_NDS, values_NSD, limit_NQ), atol=2e-5)
  for i in (0, 1, 63, 64, 200, 299):
    alone = cpu.cached_attention(q_NQD[:, i : i + 1], keys_NDS, values_NSD, limit_NQ[:, i : i + 1])
    np.testing.assert_array_equal(np.asarray(alone), together[:, i : i + 1])
  keys_NDS[:, :, t:] = np.nan
  values_NSD[:, t:] = np.nan
  np.testing.assert_array_equal(
    np.asarray(cpu.cached_attention(*map(jnp.asarray, (q_NQD, keys_NDS, values_NSD, limit_NQ)))), together
  )


def _mla_reference(q_lat_BQC, q_rope_BQR, latent_BSC, rope_BSR, limit_BQ):
  """MLA as GQA with one KV head per row: keys [latent ; rope], values the latent."""
  keys_BDS = np.concatenate([latent_BSC, rope_BSR], -1).swapaxes(1, 2)
  q_BQD = np.concatenate([q_lat_BQC, q_rope_BQR], -1)
  out = _attention_reference(q_BQD, keys_BDS, np.concatenate([latent_BSC, 0 * rope_BSR], -1), limit_BQ)
  return out[..., : latent_BSC.shape[-1]]


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_mla_attention_matches_numpy(cpu_kernel, monkeypatch, threads):
  """Ragged limits (none visible, some, past the cache's end), query rows that are not a multiple
  of 16, latent and rotary widths that are not multiples of 16 floats, scores far apart, fewer
  cache rows than threads, one position."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", threads)
  rng = np.random.default_rng(4)
  for b, q, c, r, s, spread in (
    (8, 8, 32, 16, 256, 1.0),
    (1, 72, 64, 8, 100, 1.0),
    (3, 5, 24, 6, 37, 8.0),
    (2, 17, 16, 0, 20, 1.0),
    (1, 1, 16, 4, 1, 1.0),
  ):
    q_lat = (spread * rng.normal(size=(b, q, c))).astype(np.float32)
    q_rope = (spread * rng.normal(size=(b, q, r))).astype(np.float32)
    latent = rng.normal(size=(b, s, c)).astype(np.float32)
    rope = rng.normal(size=(b, s, r)).astype(np.float32)
    limit = rng.integers(-1, s + 3, size=(b, q)).astype(np.int32)
    got = np.asarray(cpu.mla_attention(*map(jnp.asarray, (q_lat, q_rope, latent, rope, limit))))
    np.testing.assert_allclose(got, _mla_reference(q_lat, q_rope, latent, rope, limit), atol=2e-5)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_mla_attention_rows_do_not_depend_on_the_pass(cpu_kernel, monkeypatch, threads):
  """A query row's output is the same bits alone (a plain step's row) or among a verification
  pass's rows (9 tokens x 8 heads), whatever the threads; the cache past the last visible
  position is never read."""
  del cpu_kernel
  monkeypatch.setenv("MOESPEC_FFI_THREADS", threads)
  rng = np.random.default_rng(5)
  b, t, h, c, r, s = 2, 9, 8, 32, 16, 300
  q_lat = jnp.asarray(rng.normal(size=(b, t * h, c)), jnp.float32)
  q_rope = jnp.asarray(rng.normal(size=(b, t * h, r)), jnp.float32)
  latent = rng.normal(size=(b, s, c)).astype(np.float32)
  rope = rng.normal(size=(b, s, r)).astype(np.float32)
  limit = jnp.asarray(np.repeat(np.arange(200, 200 + t), h)[None].repeat(b, 0), jnp.int32)
  together = np.asarray(cpu.mla_attention(q_lat, q_rope, latent, rope, limit))
  for i in (0, 7, 8, 71):
    alone = cpu.mla_attention(q_lat[:, i : i + 1], q_rope[:, i : i + 1], latent, rope, limit[:, i : i + 1])
    np.testing.assert_array_equal(np.asarray(alone), together[:, i : i + 1])
  latent[:, 200 + t :] = np.nan
  rope[:, 200 + t :] = np.nan
  np.testing.assert_array_equal(np.asarray(cpu.mla_attention(q_lat, q_rope, latent, rope, limit)), together)
  with pytest.raises(ValueError, match="mla_attention needs"):
    cpu.mla_attention(q_lat, q_rope, latent[:, :, :16], rope, limit)


def test_clock_inside_a_compiled_loop(cpu_kernel):
  """clock_after passes its operand through and reads a clock ordered by data: readings around
  each of 3 loop iterations of real work never go back and add up to the loop's time."""
  del cpu_kernel

  def body(i, state):
    x_I, a_DD, elapsed_3 = state
    x_I, start_2 = cpu.clock_after(x_I)
    for _ in range(8):
      a_DD = jnp.tanh(a_DD @ a_DD + x_I[0].astype(jnp.float32))
    x_I, end_2 = cpu.clock_after(x_I + (a_DD[0, 0] > 2.0).astype(jnp.int32))
    return x_I, a_DD, elapsed_3.at[i].set(cpu.elapsed_ms(start_2, end_2))

  run = jax.jit(lambda x_I, a_DD: jax.lax.fori_loop(0, 3, body, (x_I, a_DD, jnp.zeros(3))))
  a_DD = jnp.full((256, 256), 1e-3, jnp.float32)
  jax.block_until_ready(run(jnp.arange(4, dtype=jnp.int32), a_DD))
  start = time.perf_counter()
  x_I, _, elapsed_3 = jax.block_until_ready(run(jnp.arange(4, dtype=jnp.int32), a_DD))
  wall_ms = (time.perf_counter() - start) * 1e3
  np.testing.assert_array_equal(x_I, np.arange(4))
  assert np.all(np.asarray(elapsed_3) > 0) and float(np.sum(elapsed_3)) <= wall_ms
