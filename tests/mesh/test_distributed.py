"""Two processes on localhost, four CPU devices each, joined by `jax.distributed` into one mesh of
eight: both write the tokens of one device."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

import moespec_jax as msj
from tests.mesh.test_generate_on_mesh import NEW, PROMPTS, SPECS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_give_one_devices_tokens(one_device, tmp_path):
  port = _free_port()
  outs = [tmp_path / f"tokens{i}.json" for i in range(2)]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  workers = [
    subprocess.Popen(
      [sys.executable, "-m", "tests.mesh.distributed_worker", str(i), str(port), str(outs[i])],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  try:
    for worker in workers:
      logs.append(worker.communicate(timeout=300)[0])
  finally:
    for worker in workers:
      worker.kill()
  for i, worker in enumerate(workers):
    assert worker.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"
  for name in ("plain", "mtp3"):
    want = msj.generate(one_device, PROMPTS, NEW, spec=SPECS[name]).tokens
    for out in outs:
      np.testing.assert_array_equal(np.asarray(json.loads(out.read_text())[name]), want, err_msg=f"{out.name} {name}")
