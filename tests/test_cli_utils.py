"""Tests of the CLI helpers: one-line errors with exit status 2, progress lines."""

import io
import pathlib
import signal
import subprocess
import sys

import pytest

from moespec_jax import cli
from moespec_jax.io.progress import Progress

CLI_PATH = pathlib.Path(cli.__file__)

# A tiny absl program. It loads cli.py by path so that the subprocess does not
# import jax (keeps the test fast and stderr free of unrelated warnings).
SCRIPT = f"""
import importlib.util
from absl import flags
from absl import logging
spec = importlib.util.spec_from_file_location("cli_under_test", {str(CLI_PATH)!r})
cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli)

flags.DEFINE_integer("n", 1, "a number")
flags.DEFINE_enum("mode", "a", ["a", "b"], "a mode")
flags.DEFINE_integer("pos", 1, "positive", lower_bound=1)

def main(argv):
  if len(argv) > 1:
    raise cli.app.UsageError("too many arguments")
  n = flags.FLAGS.n
  if n == 2:
    raise ValueError("n must not be 2,\\n  got 2")
  if n == 3:
    raise FileNotFoundError(2, "No such file or directory", "/no/model")
  if n == 4:
    raise RuntimeError("a bug")
  if n == 6:
    logging.info("library chatter at INFO stays off stderr")
    raise ValueError("after logging")
  print("ok", n)

cli.run(main)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
  path = tmp_path_factory.mktemp("cli") / "prog.py"
  path.write_text(SCRIPT)
  return path


def _run_many(script, arg_lists):
  procs = [
    subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for args in arg_lists
  ]
  results = []
  for p in procs:
    out, err = p.communicate(timeout=60)
    results.append((p.returncode, out, err))
  return results


def test_user_errors_one_line_exit_2(script):
  cases = {
    ("--n=2",): "n must not be 2, got 2",
    ("--n=3",): "/no/model",
    ("--nope=1",): "nope",
    ("--n=abc",): "abc",
    ("--mode=c",): "mode",
    ("--pos=0",): "pos",
    ("extra",): "too many arguments",
    ("--n=6",): "after logging",
  }
  results = _run_many(script, list(cases) + [("--n=5",), ("--n=4",)])
  for (args, expected), (rc, out, err) in zip(cases.items(), results):
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (args, rc, err)
    assert len(lines) == 1, (args, err)
    assert lines[0].startswith("error: ") and expected in lines[0], (args, err)
    assert "Traceback" not in err and out == ""
  rc, out, err = results[-2]
  assert rc == 0 and out == "ok 5\n" and err == ""
  rc, out, err = results[-1]  # a bug keeps its traceback and is not status 2
  assert rc not in (0, 2) and "Traceback" in err


def test_progress_lines():
  now = [0.0]
  stream = io.StringIO()
  prog = Progress(100, desc="train", every_s=10.0, stream=stream, clock=lambda: now[0])
  now[0] = 5.0
  assert not prog.update(10, units=1000)
  now[0] = 10.0
  assert prog.update(20, units=1000, loss=2.5)
  line = stream.getvalue().strip()
  assert line.startswith("train step 20/100 (20.0%)")
  assert "200 tokens/s" in line and "loss 2.5" in line and "eta 40s" in line
  assert prog.update(100)  # the last step always prints
  assert "eta" not in prog.last_line and len(stream.getvalue().splitlines()) == 2
  by_steps = Progress(50, every_s=None, every_steps=10, stream=io.StringIO(), start_step=20, clock=lambda: now[0])
  assert [by_steps.update(s) for s in range(21, 41)].count(True) == 2
  emitted = []
  to_log = Progress(3, every_s=None, every_steps=1, emit=emitted.append, clock=lambda: now[0])
  assert to_log.update(1) and to_log.update(3)
  assert emitted == [to_log.format(1, now[0], {}), to_log.last_line] and emitted[-1].startswith("step 3/3")
  with pytest.raises(ValueError, match="emit or stream"):
    Progress(3, emit=emitted.append, stream=io.StringIO())


def test_list_flags_name_the_flag():
  assert cli.int_list("batch_sizes", ["1", "8"]) == [1, 8]
  assert cli.int_list("num_drafts", ["0", "2"], minimum=0) == [0, 2]
  with pytest.raises(ValueError, match="--batch_sizes must be a list of integers"):
    cli.int_list("batch_sizes", ["1", "x"])
  with pytest.raises(ValueError, match="--n_list values must be >= 1"):
    cli.int_list("n_list", ["0"])
  with pytest.raises(ValueError, match="--n_list values must be >= 1"):
    cli.int_list("n_list", [])
  with pytest.raises(ValueError, match="--num_drafts values must be >= 0"):
    cli.int_list("num_drafts", ["-1"], minimum=0)
  assert cli.float_list("temperatures", ["0", "1.5"]) == [0.0, 1.5]
  with pytest.raises(ValueError, match="--temperatures must be a list of numbers"):
    cli.float_list("temperatures", ["hot"])
  for bad in (["-1"], ["nan"], ["inf"], []):
    with pytest.raises(ValueError, match="--temperatures values must be finite numbers >= 0"):
      cli.float_list("temperatures", bad)
  assert cli.choice_list("routings", ["correlated"], ("uniform", "correlated")) == ["correlated"]
  for bad in (["uniform", "zipf"], []):
    with pytest.raises(ValueError, match="--routings must be among uniform, correlated; got"):
      cli.choice_list("routings", bad, ("uniform", "correlated"))


# An experiment-like program: the shared --model flag, a --quick smoke run, a resumable main.
EXPERIMENT = f"""
import importlib.util
import sys
import time
from absl import flags
spec = importlib.util.spec_from_file_location("cli_under_test", {str(CLI_PATH)!r})
cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli)

model = cli.define_model_flag()
repeats = flags.DEFINE_integer("repeats", 7, "timed repeats")
sizes = flags.DEFINE_list("sizes", ["1", "8"], "sizes")
top_p = flags.DEFINE_float("top_p", 1.0, "top-p")
wait = flags.DEFINE_bool("wait", False, "wait to be interrupted")
quick = cli.define_quick_flag("small", {{"repeats": 3, "sizes": ["1"]}})

def main(argv):
  if top_p.value == 0:
    raise ValueError("top_p must be in (0, 1], got 0.0")
  if top_p.value == 2:
    raise ValueError("prompt length (3) + max_new_tokens (9) exceeds the model's max_seq_len (8)")
  if wait.value:
    print("ready", flush=True)
    time.sleep(60)
  print(repeats.value, sizes.value, model.value)

cli.run(main, resumable=sys.argv[0].endswith("resumable.py"))
"""


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
  folder = tmp_path_factory.mktemp("experiment")
  for name in ("prog.py", "resumable.py"):
    (folder / name).write_text(EXPERIMENT)
  return folder


def test_quick_sets_its_defaults_where_no_flag_was_given(experiment):
  results = _run_many(
    experiment / "prog.py", [(), ("--quick",), ("--quick", "--repeats=5"), ("--quick", "--sizes=2,4", "--checkpoint=m")]
  )
  assert [out for _, out, _ in results] == [
    "7 ['1', '8'] None\n",
    "3 ['1'] None\n",
    "5 ['1'] None\n",
    "3 ['2', '4'] m\n",
  ]


def test_help_lists_the_shared_flags_and_quick_says_what_it_sets(experiment):
  out = subprocess.run(
    [sys.executable, str(experiment / "prog.py"), "--help"], capture_output=True, text=True, timeout=60
  ).stdout
  for flag in ("--model", "--checkpoint", "--repeats", "--sizes", "--[no]quick"):
    assert f"  {flag}:" in out, out
  assert "--repeats=3 --sizes=1; a flag given explicitly keeps its value" in " ".join(out.split())


def test_a_library_argument_is_named_as_its_flag(experiment):
  (rc, _, err), (rc2, _, err2) = _run_many(experiment / "prog.py", [("--top_p=0",), ("--top_p=2",)])
  assert rc == rc2 == 2
  assert err == "error: --top_p must be in (0, 1], got 0.0\n"
  assert err2.startswith("error: prompt length (3)")  # not a flag of this program: as it was


@pytest.mark.parametrize(
  "name, message", [("resumable.py", "interrupted; resume with the same command\n"), ("prog.py", "interrupted\n")]
)
def test_ctrl_c_says_interrupted_not_error(experiment, name, message):
  proc = subprocess.Popen(
    [sys.executable, str(experiment / name), "--wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  assert proc.stdout.readline() == "ready\n"
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == cli.EXIT_INTERRUPTED and err == message


def test_model_flag_config_specs():
  """--model=config:NAME[,seed=S][,size=tiny][,KEY=VALUE]: a random model of configs/NAME.py, each
  other key applied by the caller's variants; bad specs name --model."""
  assert cli.parse_model_spec("config:membound_fine,size=tiny,seed=3") == (
    "membound_fine",
    {"size": "tiny", "seed": "3"},
  )
  model = cli.load_model("config:membound_fine,size=tiny", variants={"tag": lambda m, v: (m, v)})
  assert model.config.n_routed_experts == 64 and model.config.top_k == 6 and model.config.num_mtp_modules == 1
  tagged, value = cli.load_model("config:membound_coarse,size=tiny,tag=x", variants={"tag": lambda m, v: (m, v)})
  assert value == "x" and tagged.config.n_routed_experts == 8
  for bad, message in [
    ("config:nope", "no configs/nope.py"),
    ("config:membound_fine,size=tiny,routing=correlated", "option 'routing' is not known"),
    ("config:membound_fine,seed=a", "seed must be an integer"),
    ("config:tiny,size=tiny", "size must be full"),
    ("config:membound_fine,size", "key=value"),
  ]:
    with pytest.raises(ValueError, match=message):
      cli.load_model(bad)
