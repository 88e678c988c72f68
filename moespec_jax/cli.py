"""Helpers for absl entry points: one-line errors with exit status 2, list flags, the model flag.

Usage in `experiments/NAME.py`:

  def main(argv):
    ...

  if __name__ == "__main__":
    cli.run(main)

A bad flag, a `ValueError`, an `OSError` (missing file...) or `app.UsageError` prints a
single `error: <message>` line on stderr and exits with status 2, without a
traceback or usage text; a message that opens with one of the program's flag names names it
as `--flag`, as the flag checks do. Other exceptions keep their traceback (they are bugs).
Ctrl-C prints `interrupted` (with `resumable`: how to resume) and exits with status 130.

`--help` lists the program's own flags and those defined here (`--model`, `--quick`).
`--model=config:NAME` runs on a randomly initialised model of `configs/NAME.py` (`load_model`).
`define_quick_flag` gives an experiment its smoke run: defaults for some flags, applied before
`main` to the flags the command line leaves unset (a flag given explicitly keeps its value).
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from absl import app, flags

if TYPE_CHECKING:
  from moespec_jax.api import Model

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# OSError covers missing files and a --config file that ml_collections failed to load.
_USER_ERRORS = (ValueError, OSError, app.UsageError)


def one_line(message: object) -> str:
  """The message on one line (whitespace runs, newlines included, collapsed)."""
  return " ".join(str(message).split())


def fail(message: object, status: int = EXIT_USAGE) -> None:
  """Prints `error: <message>` on one stderr line and exits with `status`."""
  sys.stdout.flush()
  sys.stderr.write(f"error: {one_line(message)}\n")
  sys.stderr.flush()
  sys.exit(status)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """Parses absl flags; a flag error becomes `fail(...)` (exit 2, one line)."""
  try:
    return flags.FLAGS(list(argv))
  except flags.Error as e:
    fail(e)
    raise  # unreachable


def _number_list(
  flag: str, values: Sequence[str], cast: Callable[[str], float], noun: str, bound: str, minimum: float
) -> list:
  """A list flag's values through `cast`, finite and >= `minimum`; ValueError naming --flag otherwise
  (`noun`: what the values must be; `bound`: how the lower bound is said)."""
  try:
    out = [cast(v) for v in values]
  except ValueError:
    raise ValueError(f"--{flag} must be a list of {noun}, got {list(values)}") from None
  if not out or not all(math.isfinite(v) and v >= minimum for v in out):
    raise ValueError(f"--{flag} values must be {bound}>= {minimum:g}, got {list(values)}")
  return out


def int_list(flag: str, values: Sequence[str], minimum: int = 1) -> list[int]:
  """A list flag's values as integers >= `minimum`; ValueError naming --flag otherwise."""
  return _number_list(flag, values, int, "integers", "", minimum)


def float_list(flag: str, values: Sequence[str], minimum: float = 0.0) -> list[float]:
  """A list flag's values as finite numbers >= `minimum`; ValueError naming --flag otherwise."""
  return _number_list(flag, values, float, "numbers", "finite numbers ", minimum)


def check_choices(name: str, values: Sequence[str], known: Sequence[str]) -> list[str]:
  """`values` as a list, each among `known` (and at least one); ValueError naming `name`
  otherwise (a library argument's name, or a flag's with its dashes)."""
  if not values or set(values) - set(known):
    raise ValueError(f"{name} must be among {', '.join(known)}; got {list(values)}")
  return list(values)


def choice_list(flag: str, values: Sequence[str], known: Sequence[str]) -> list[str]:
  """A list flag's values, each among `known` (and at least one); ValueError naming --flag otherwise."""
  return check_choices(f"--{flag}", values, known)


def define_model_flag(
  unset: str = "the default trained model, trained and cached on first use", aliases: Sequence[str] = ("checkpoint",)
) -> flags.FlagHolder:
  """`--model=DIR` (alias `--checkpoint`, and any other `aliases`), the model an experiment runs on: a
  directory of ours or a Hugging Face one (`Model.load`); unset, the default trained model (`load_model`).
  `unset`: what the help says an unset flag means."""
  holder = flags.DEFINE_string(
    "model",
    None,
    f"Model directory, ours or a Hugging Face one, or config:NAME[,seed=S][,size=tiny] for a randomly "
    f"initialised model of configs/NAME.py, e.g. config:membound_coarse (default: {unset}).",
  )
  for alias in aliases:
    flags.DEFINE_alias(alias, "model")
  return holder


# --quick's defaults of this program: flag name (or `config.a.b` for a field of --config) -> value.
_QUICK_DEFAULTS: dict[str, Any] = {}


def _shown(value: Any) -> str:
  if isinstance(value, (list, tuple)):
    return ",".join(str(v) for v in value)
  return str(value).lower() if isinstance(value, bool) else str(value)


def define_quick_flag(what: str, defaults: dict[str, Any]) -> flags.FlagHolder:
  """`--quick`: a smoke run (`what`), measured as the full run is, on the flag values `defaults`
  (flag name -> value as the flag holds it, a list flag's strings; `config.a.b` names the field
  `a.b` of --config). A flag given on the command line keeps its value."""
  _QUICK_DEFAULTS.update(defaults)
  settings = " ".join(f"--{name}={_shown(value)}" for name, value in _QUICK_DEFAULTS.items())
  return flags.DEFINE_bool(
    "quick", False, f"A smoke run ({what}): {settings}; a flag given explicitly keeps its value."
  )


def apply_quick() -> None:
  """With --quick, sets its defaults on the flags (and --config fields) the command line left unset."""
  if not _QUICK_DEFAULTS or not flags.FLAGS["quick"].value:
    return
  for name, value in _QUICK_DEFAULTS.items():
    if name.startswith("config."):
      from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

      path = name[len("config.") :]
      if path not in config_flags.get_override_values(flags.FLAGS["config"]):
        *parents, field = path.split(".")
        node = flags.FLAGS["config"].value
        for parent in parents:
          node = node[parent]
        node[field] = value
    elif not flags.FLAGS[name].present:
      flags.FLAGS[name].value = value


CONFIG_PREFIX = "config:"


def parse_model_spec(value: str) -> tuple[str, dict[str, str]]:
  """`config:NAME[,key=value...]` -> (NAME, {key: value}); ValueError naming --model otherwise."""
  if not value.startswith(CONFIG_PREFIX):
    raise ValueError(f"--model {value!r} is not a config: model spec")
  name, *options = value[len(CONFIG_PREFIX) :].split(",")
  if not re.fullmatch(r"[A-Za-z_]\w*", name):
    raise ValueError(f"--model config: needs a config name (configs/NAME.py), got {value!r}")
  settings = {}
  for option in options:
    key, sep, setting = option.partition("=")
    if not sep or not key or key in settings:
      raise ValueError(f"--model options must be distinct key=value pairs after the config name, got {value!r}")
    settings[key] = setting
  return name, settings


def model_from_config(name: str, *, seed: int = 0, size: str = "full") -> Model:
  """`Model.init` on configs/NAME.py's model (its `tiny()` at size "tiny"): random weights, the
  config's tokenizer (the byte tokenizer for the memory-bound configs) and MTP modules if any."""
  from moespec_jax.api import Model  # pylint: disable=g-import-not-at-top (cli stays light)
  from moespec_jax.config import model_config_from  # pylint: disable=g-import-not-at-top

  try:
    module = importlib.import_module(f"configs.{name}")
  except ModuleNotFoundError:
    raise ValueError(f"--model config:{name}: no configs/{name}.py") from None
  if size not in ("full", "tiny") or (size == "tiny" and not hasattr(module, "tiny")):
    raise ValueError(f"--model config:{name}: size must be full{' or tiny' * hasattr(module, 'tiny')}, got {size!r}")
  cfg = module.tiny() if size == "tiny" else module.get_config()
  return Model.init(model_config_from(cfg.model), seed)


def load_model(
  path: str | None, *, train_heads: bool = True, variants: Mapping[str, Callable[[Model, str], Model]] | None = None
) -> Model:
  """`Model.load(path)`, or without a path the default trained model (trained on first use;
  `train_heads`: with its MTP heads). `config:NAME[,seed=S][,size=tiny][,KEY=VALUE...]`: a random
  model of configs/NAME.py (`model_from_config`), each other KEY applied by `variants[KEY](model,
  VALUE)` (the research harness's model variants, e.g. routing=correlated)."""
  if path and path.startswith(CONFIG_PREFIX):
    name, settings = parse_model_spec(path)
    seed_text = settings.pop("seed", "0")
    if not seed_text.isdigit():
      raise ValueError(f"--model seed must be an integer >= 0, got {seed_text!r}")
    model = model_from_config(name, seed=int(seed_text), size=settings.pop("size", "full"))
    for key, setting in settings.items():
      if key not in (variants or {}):
        known = ", ".join(["seed", "size", *(variants or {})])
        raise ValueError(f"--model option {key!r} is not known here (known: {known})")
      model = variants[key](model, setting)
    return model
  if path:
    from moespec_jax.api import Model  # pylint: disable=g-import-not-at-top (cli stays light)

    return Model.load(path)
  from moespec_jax.default_model import ensure_default_model  # pylint: disable=g-import-not-at-top

  return ensure_default_model(train_heads=train_heads)


def _message(error: BaseException) -> str:
  if isinstance(error, FileNotFoundError) and error.filename:
    return f"{error.strerror or 'file not found'}: {error.filename}"
  text = one_line(error) or type(error).__name__
  # A library argument named as a flag of this program: `top_p must ...` -> `--top_p must ...`.
  match = re.match(r"(\w+)(?= must\b|=| \()", text)
  if match and match.group(1) in _key_flag_names():
    text = "--" + text
  return text


def _key_flag_names() -> set[str]:
  """The names of the flags `--help` lists for the main program."""
  return {f.name for f in flags.FLAGS.get_key_flags_for_module(sys.argv[0])}


def _show_shared_flags_in_help() -> None:
  """Makes the flags defined in this package (`--model`, `--quick`...) key flags of the main program,
  so that `--help` lists them beside its own (absl shows other modules' flags under --helpfull only)."""
  for module, module_flags in flags.FLAGS.flags_by_module_dict().items():
    if module == __name__ or module.startswith("moespec_jax."):
      for flag in module_flags:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def run(
  main: Callable[[list[str]], object],
  argv: Sequence[str] | None = None,
  *,
  verbosity: int = -1,
  resumable: bool = False,
) -> None:
  """`absl.app.run(main)` with one-line user errors and exit status 2, --quick's defaults applied
  (`define_quick_flag`), and the persistent cache of compiled programs on (`io/compile_cache.enable`:
  a rerun loads what an earlier run compiled).

  Args:
    main: the program; receives the arguments left after the flags.
    argv: the command line (default `sys.argv`).
    verbosity: default of absl's `--verbosity` (-1 WARNING, 0 INFO). WARNING
      keeps INFO logs of libraries (jax backend probing, orbax) off stderr, so
      an error is the only stderr line; `--verbosity=0` shows them.
    resumable: the program resumes where an interrupted run stopped when rerun the same way;
      Ctrl-C then says so.
  """
  verbosity_given = []
  _show_shared_flags_in_help()

  def parser(args: list[str]) -> list[str]:
    rest = parse_flags(args)
    verbosity_given.append(not flags.FLAGS["verbosity"].using_default_value)
    return rest

  def interrupted() -> None:
    sys.stdout.flush()
    sys.stderr.write("interrupted; resume with the same command\n" if resumable else "interrupted\n")
    sys.stderr.flush()
    sys.exit(EXIT_INTERRUPTED)

  def wrapped(args: list[str]) -> object:
    # absl raises an unset --verbosity to INFO after parsing; apply ours instead.
    if verbosity_given and not verbosity_given[-1]:
      flags.FLAGS.verbosity = verbosity
    try:
      apply_quick()
      from moespec_jax.io import compile_cache  # pylint: disable=g-import-not-at-top

      compile_cache.enable()  # a rerun loads its compiled programs
      return main(args)
    except _USER_ERRORS as e:
      fail(_message(e))
    except KeyboardInterrupt:
      interrupted()
    return None

  app.run(wrapped, argv=None if argv is None else list(argv), flags_parser=parser)
