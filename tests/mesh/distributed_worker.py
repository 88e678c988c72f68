"""One process of the two-process test (test_distributed.py): joins the run, places the mesh test
model on a (data 2, expert 4) mesh over both processes' devices, and writes its greedy tokens.

Usage: python -m tests.mesh.distributed_worker PROCESS_ID PORT OUT_JSON
"""

import json
import os
import re
import sys


def main(process_id: int, port: int, out_path: str) -> None:
  # Four CPU devices a process (the mesh run's environment asks for eight).
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
  from moespec_jax.parallel import mesh as mesh_lib

  mesh_lib.initialize(f"localhost:{port}", num_processes=2, process_id=process_id, timeout_s=120)
  import jax

  import moespec_jax as msj
  from tests.conftest import TINY
  from tests.mesh.test_generate_on_mesh import NEW, PROMPTS, SPECS

  assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
  config = msj.ModelConfig(**TINY).replace(num_mtp_modules=1)
  model = msj.Model.init(config, seed=3, mesh=mesh_lib.make_mesh(2, 4))
  tokens = {name: msj.generate(model, PROMPTS, NEW, spec=SPECS[name]).tokens.tolist() for name in ("plain", "mtp3")}
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(tokens, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
