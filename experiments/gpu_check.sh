#!/usr/bin/env bash
# GPU check (one run, under 8 minutes): both Pallas GPU kernels (pallas_kernels/gpu, Triton lowering) against the XLA
# reference on the GPU in f32 and bf16, then the kernel benchmark on the GPU.
#   bash experiments/gpu_check.sh [OUT_DIR]      (default: $OUT, else runs/gpu_check)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-runs/gpu_check}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=".venv/bin/python"

timeout 180 "$PY" - "$OUT_DIR" <<'PYEOF'
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import gpu
from pallas_kernels.reference import expert_ffn_reference
out_dir = sys.argv[1]
assert jax.default_backend() == "gpu", f"no GPU visible to JAX (backend {jax.default_backend()})"
results = []
cases = [  # (n_tokens, n_experts, top_k, d_model, hidden, routing)
    (1, 8, 2, 256, 384, "random"), (5, 8, 2, 256, 384, "skip_last"), (7, 8, 2, 256, 384, "one"),
    (3, 4, 1, 512, 256, "random"), (16, 16, 8, 256, 384, "random"), (8, 64, 6, 2048, 1408, "random")]
for (n, e, k, d, f, routing) in cases:
  keys = jax.random.split(jax.random.key(n), 6)
  x = jax.random.normal(keys[0], (n, d))
  hi = e - 1 if routing == "skip_last" else e
  ids = jax.vmap(lambda kk: jax.random.choice(kk, hi, (k,), replace=False))(jax.random.split(keys[1], n))
  if routing == "one":
    ids = ids.at[:, 0].set(0)
  ids = ids.astype(jnp.int32)
  g = jax.nn.softmax(jax.random.normal(keys[2], (n, k)), -1)
  w = [jax.random.normal(keys[3], (e, d, f)) / np.sqrt(d), jax.random.normal(keys[4], (e, d, f)) / np.sqrt(d),
       jax.random.normal(keys[5], (e, f, d)) / np.sqrt(f)]
  ref = expert_ffn_reference(x, ids, g, *w)
  for dtype, tol in ((jnp.float32, 2e-3), (jnp.bfloat16, 6e-2)):
    args = [x.astype(dtype), ids, g.astype(dtype)] + [a.astype(dtype) for a in w]
    for method in ("dedup", "per_slot"):
      t0 = time.perf_counter()
      y = jax.block_until_ready(gpu.expert_ffn_gpu(*args, method=method))
      err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))
      ok = err <= tol
      results.append(dict(n=n, experts=e, top_k=k, d_model=d, hidden=f, routing=routing, dtype=jnp.dtype(dtype).name,
                          method=method, max_abs_err=err, tol=tol, ok=ok, first_call_s=time.perf_counter() - t0))
      print(("OK  " if ok else "FAIL"), results[-1], flush=True)
with open(os.path.join(out_dir, "gpu_kernel_check.json"), "w") as fh:
  json.dump(results, fh, indent=1)
bad = [r for r in results if not r["ok"]]
print(f"{len(results) - len(bad)}/{len(results)} kernel checks passed")
sys.exit(1 if bad else 0)
PYEOF

# Benchmark: GPU kernels; mixtral limited to a subset of experts by --max_weight_gb.
timeout 270 "$PY" -m experiments.kernel_bench --workdir="$OUT_DIR/kernel_bench" \
  --shapes=tiny,deepseek_v2_lite,qwen3_30b_a3b,mixtral_8x7b --n_list=1,2,4,8,16 --repeats=10 \
  --max_weight_gb=8 --backend=gpu
echo "gpu_check done: $OUT_DIR"
