"""experiments.spec_bench: the --quick sweep end to end, and one-line CLI errors."""

import json

import pytest

import moespec_jax as msj
from tests.cli_run import run_module


def _run(*args):
  return run_module("experiments.spec_bench", *args, timeout=600)


def test_quick_sweep_writes_the_documented_metrics(tiny_config, tmp_path):
  msj.Model.init(tiny_config.replace(num_mtp_modules=1, max_seq_len=512), seed=0).save(tmp_path / "m")
  res = _run(f"--workdir={tmp_path / 'out'}", f"--model={tmp_path / 'm'}", "--quick")
  assert res.returncode == 0, res.stderr
  rows = json.loads((tmp_path / "out" / "metrics.json").read_text())["spec_bench"]["rows"]
  assert {r["drafter"] for r in rows} == {"mtp", "ngram"}
  for r in rows:
    for key in (
      "drafter",
      "num_draft",
      "batch_size",
      "temperature",
      "tokens_per_second",
      "plain_tokens_per_second",
      "speedup",
      "mean_accepted_length",
    ):
      assert key in r
  assert (tmp_path / "out" / "speedup_vs_k.png").stat().st_size > 0


def test_bad_flag_is_one_line_and_exit_2(tmp_path):
  res = _run(f"--workdir={tmp_path}", "--max_new_tokens=notanumber")
  assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1


def test_a_checkpoint_without_tokenizer_gets_byte_prompts(tiny_config):
  from moespec_jax.data import corpus  # pylint: disable=g-import-not-at-top
  from moespec_jax.data.tokenizer import MissingTokenizer  # pylint: disable=g-import-not-at-top
  from moespec_jax.research import spec_bench  # pylint: disable=g-import-not-at-top

  model = msj.Model.init(tiny_config, seed=0)
  text, encoding = spec_bench.bench_prompts(model, 2, 64, log=lambda *_: None)
  assert encoding == "tokenizer" and text == corpus.held_out_prompts(2, prompt_bytes=64, seed=0)
  model.tokenizer = MissingTokenizer("a random checkpoint", vocab_size=264, eos_id=256, bos_id=257)
  ids, encoding = spec_bench.bench_prompts(model, 2, 64, log=lambda *_: None)
  assert encoding == "utf8_bytes" and ids == [list(t.encode("utf-8")) for t in text]
  small = msj.Model.init(tiny_config.replace(vocab_size=200, eos_id=198, bos_id=199), seed=0)
  small.tokenizer = MissingTokenizer("a random checkpoint", vocab_size=200, eos_id=198, bos_id=199)
  with pytest.raises(ValueError, match="a random checkpoint has no tokenizer.json and a vocabulary of 200"):
    spec_bench.bench_prompts(small, 2, 64)
