"""What every stage file shares: `StageConfig` and the command line.

  python -m experiments.stage_8k --preset=tiny --workdir=runs/tiny --steps=50 \
      --set optim.peak_lr=1e-3 --set model.num_layers=5 --set data.source=text:corpus/

`--set key=value` replaces one field of the stage's `StageConfig`; nested fields are reached
with a dot (`optim.*`, `data.*`, `mesh.*`, and `model.*` for the preset's `ModelConfig`). The
value is parsed to the field's type ("None" for optional fields; `mesh=fsdp=-1,context=4`).
An unknown key is an error that suggests the nearest valid ones, raised before anything is
compiled; `--list-keys` prints every key with the preset's value. `--help` shows each preset's
steps, length and batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import types
import typing
from typing import Any, Mapping, Sequence

import jax

from sparse_lm.config import ModelConfig
from sparse_lm.data import DataConfig
from sparse_lm.fs import write_failure
from sparse_lm.sharding import MeshLayout
from sparse_lm.train import metrics as metrics_lib
from sparse_lm.train.config import StageConfig
from sparse_lm.train.optimizer import OptimizerConfig
from sparse_lm.train.workdir import local_workdir

__all__ = ["StageConfig", "OptimizerConfig", "DataConfig", "MeshLayout", "apply_overrides",
           "main", "valid_keys"]

_NESTED = {"optim": OptimizerConfig, "data": DataConfig, "mesh": MeshLayout}
_NOT_SETTABLE = {"model_overrides", "optim", "data"}  # set their fields: model.x, optim.x
# Names a newcomer tries first (other codebases' spellings) -> the key here.
_ALIASES = {"lr": "optim.peak_lr", "learning_rate": "optim.peak_lr",
            "warmup": "optim.warmup_steps", "weight_decay": "optim.weight_decay",
            "batch_size": "tokens_per_batch", "global_batch_size": "tokens_per_batch",
            "max_steps": "steps", "num_steps": "steps", "train_steps": "steps",
            "max_seq_len": "seq_len", "seq_length": "seq_len", "context_length": "seq_len",
            "gradient_accumulation_steps": "micro_batches", "dataset": "data.source",
            "layers": "model.num_layers", "n_layer": "model.num_layers",
            "hidden_size": "model.d_model", "d_model": "model.d_model",
            "vocab_size": "model.vocab_size", "eval_interval": "eval_every",
            "save_interval": "checkpoint_every", "grad_clip": "optim.clip_norm"}


def valid_keys() -> list[str]:
  """Every key `--set` accepts."""
  keys = [f.name for f in dataclasses.fields(StageConfig)
          if f.name not in _NOT_SETTABLE]
  for prefix, cls in list(_NESTED.items()) + [("model", ModelConfig)]:
    keys += [f"{prefix}.{f.name}" for f in dataclasses.fields(cls)]
  return keys


def closest_keys(key: str, valid: list[str], aliases: list[str], *, n: int,
                 field_cutoff: float = 0.6) -> list[str]:
  """Up to n of `valid` for an unknown `--set` key: `aliases` first (the keys a name from other
  trainers means), then keys spelled like `key`, then keys whose last part (after the group's
  dot) is spelled like key's; each once, `key` itself left out. Shared by the stage and RL CLIs."""
  bare = key.rpartition(".")[2].lower()
  out = list(aliases) + difflib.get_close_matches(key, valid, n=n, cutoff=0.6)
  by_field = {}
  for k in valid:
    by_field.setdefault(k.rpartition(".")[2], []).append(k)
  for field in difflib.get_close_matches(bare, list(by_field), n=n, cutoff=field_cutoff):
    out += by_field[field]
  return [k for k in dict.fromkeys(out) if k != key][:n]


def nearest_keys(key: str, n: int = 5) -> list[str]:
  """The valid `--set` keys closest to an unknown `key` (aliases, then spelling)."""
  alias = _ALIASES.get(key.rpartition(".")[2].lower())
  return closest_keys(key, valid_keys(), [alias] if alias else [], n=n)


def _parse(text: str, tp: Any, key: str) -> Any:
  """`text` as a value of type `tp` (int, float, bool, str, Optional, MeshLayout, literal)."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):
    if text.strip().lower() in ("none", "null") and type(None) in args:
      return None
    errors = []
    for a in args:
      if a is type(None):
        continue
      try:
        return _parse(text, a, key)
      except ValueError as e:
        errors.append(str(e))
    raise ValueError(f"--set {key}={text!r}: " + "; ".join(errors))
  if tp is bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
      return True
    if low in ("0", "false", "no", "off"):
      return False
    raise ValueError(f"--set {key}={text!r}: expected a bool (true/false)")
  if tp is int:
    try:
      return int(text.replace("_", ""))
    except ValueError:
      raise ValueError(f"--set {key}={text!r}: expected an int") from None
  if tp is float:
    try:
      return float(text)
    except ValueError:
      raise ValueError(f"--set {key}={text!r}: expected a float") from None
  if tp is str:
    return text
  if tp is MeshLayout:
    return MeshLayout.parse(text)
  raise ValueError(f"--set {key}: fields of type {tp} cannot be set from the command line")


def _hints(cls) -> Mapping[str, Any]:
  return typing.get_type_hints(cls)


def apply_overrides(stage: StageConfig, sets: Sequence[str]) -> StageConfig:
  """`stage` with each "key=value" of `sets` applied (see the module docstring).

  Raises:
    ValueError: a malformed item, an unknown key (the message suggests the nearest ones) or a
      value that does not parse to the field's type.
  """
  top: dict[str, Any] = {}
  nested: dict[str, dict[str, Any]] = {p: {} for p in _NESTED}
  model: dict[str, Any] = dict(stage.model_overrides)
  valid = valid_keys()
  for item in sets:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
      raise ValueError(f"--set expects key=value, got {item!r}")
    if key not in valid:
      near = nearest_keys(key)
      raise ValueError(f"unknown --set key {key!r}; "
                       + (f"did you mean {', '.join(near)}? " if near else "")
                       + "(`python -m experiments.stage_8k --list-keys` prints every key "
                       "with its value)")
    prefix, _, field = key.partition(".")
    if not field:
      top[key] = _parse(text, _hints(StageConfig)[key], key)
    elif prefix == "model":
      model[field] = _parse(text, _hints(ModelConfig)[field], key)
    else:
      nested[prefix][field] = _parse(text, _hints(_NESTED[prefix])[field], key)
  for prefix, changes in nested.items():
    if changes:
      top[prefix] = dataclasses.replace(top.get(prefix, getattr(stage, prefix)), **changes)
  if model:
    top["model_overrides"] = tuple(sorted(model.items()))
  out = dataclasses.replace(stage, **top)
  out.validate()
  return out


def _preset_line(preset: str, stage: StageConfig) -> str:
  return (f"  {preset:<6} {stage.steps:>7,} steps x {stage.global_batch:,} sequences of "
          f"{stage.seq_len:,} tokens ({stage.tokens_per_batch:,} tokens/step), "
          f"{stage.micro_batches} micro-batch(es), peak lr {stage.optim.peak_lr:g}, eval every "
          f"{stage.eval_every}, checkpoint every {stage.checkpoint_every}")


def current_values(stage: StageConfig) -> dict[str, Any]:
  """Every `--set` key with its value in `stage`."""
  model = stage.model_config()
  out = {}
  for key in valid_keys():
    prefix, _, field = key.partition(".")
    if not field:
      out[key] = getattr(stage, key)
    elif prefix == "model":
      out[key] = getattr(model, field)
    else:
      out[key] = getattr(getattr(stage, prefix), field)
  return out


def build_stage(stages: Mapping[str, StageConfig], argv: Sequence[str] | None = None
                ) -> tuple[StageConfig, str, argparse.Namespace]:
  """Parse the command line into (stage config, workdir, args); errors exit with a message."""
  name = next(iter(stages.values())).name
  presets = "\n".join(_preset_line(p, s) for p, s in stages.items())
  parser = argparse.ArgumentParser(
      prog=f"python -m experiments.{name}", formatter_class=argparse.RawDescriptionHelpFormatter,
      description=f"Train {name} (see experiments/{name}.py). Presets:\n{presets}",
      epilog="Any StageConfig field can be changed with --set KEY=VALUE (model.*, optim.*, "
             "data.*, mesh.*); --list-keys prints every key with the preset's value. Progress "
             "and routing health go to <workdir>/<stage>/tb/metrics.jsonl (and TensorBoard).")
  parser.add_argument("--preset", default="tiny", choices=sorted(stages))
  parser.add_argument("--workdir", default=None, help="default ./runs/<preset>")
  parser.add_argument("--steps", type=int, default=None, help="optimizer steps of this stage")
  parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                      help="override a StageConfig field (model.*, optim.*, data.*, mesh.*)")
  parser.add_argument("--list-keys", action="store_true",
                      help="print every --set key with its value for --preset, and exit")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar: a plain line every --progress-every steps (also "
                           "the default when stdout is not a terminal)")
  parser.add_argument("--progress-every", type=int, default=50, metavar="N",
                      help="steps between plain progress lines (default 50)")
  parser.add_argument("--allow-config-change", action="store_true",
                      help="resume although the stage config saved in the checkpoint differs "
                           "in steps, schedule, batch or data (the differences are printed)")
  alerts = metrics_lib.Alerts()
  parser.add_argument("--warn-drop-rate", type=float, default=alerts.drop_rate, metavar="F",
                      help="warn when the expert-parallel drop rate passes F (default "
                           f"{alerts.drop_rate:g})")
  parser.add_argument("--warn-max-mean-load", type=float, default=alerts.max_mean_load,
                      metavar="F", help="warn when a layer's max/mean expert load passes F "
                                        f"(default {alerts.max_mean_load:g})")
  parser.add_argument("--warn-dead-frac", type=float, default=alerts.dead_frac, metavar="F",
                      help="warn when a layer's fraction of dead experts passes F (default "
                           f"{alerts.dead_frac:g})")
  args = parser.parse_args(argv)
  stage = stages[args.preset]
  try:
    if args.steps is not None:
      stage = dataclasses.replace(stage, steps=args.steps)
    stage = apply_overrides(stage, args.sets)
  except ValueError as e:
    parser.error(str(e))
  if args.progress_every < 1:
    parser.error(f"--progress-every={args.progress_every} must be >= 1")
  workdir = args.workdir or f"runs/{args.preset}"
  try:
    path = local_workdir(workdir)
  except ValueError as e:
    parser.error(str(e))
  if (path / stage.name).exists() and not (path / stage.name).is_dir():
    parser.error(f"--workdir={workdir}: {path / stage.name} (the stage's directory) is a file; "
                 "move it aside or give another --workdir")
  return stage, workdir, args


def enable_compilation_cache(directory: str) -> None:
  """Persist compiled XLA programs in `directory`: a rerun (or a resumed run) of the same stage
  skips its compiles. Set SPARSE_LM_XLA_CACHE to share one cache between workdirs."""
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(stages: Mapping[str, StageConfig], argv: Sequence[str] | None = None) -> int:
  """Entry point of `python -m experiments.<stage>`; returns the exit status."""
  stage, workdir, args = build_stage(stages, argv)
  if args.list_keys:
    for key, value in current_values(stage).items():
      print(f"{key}={value}")
    return 0
  from sparse_lm.distributed import failed, maybe_initialize
  maybe_initialize()  # jax.distributed on pods / Slurm / mpirun; nothing on one host
  # pylint: disable=g-import-not-at-top  (after the CLI is validated: --help stays fast)
  from sparse_lm.train.checkpoint import UnreadableCheckpointError
  from sparse_lm.train.loop import NonFiniteLossError, run
  from sparse_lm.train.workdir import WorkdirLockedError
  enable_compilation_cache(os.environ.get("SPARSE_LM_XLA_CACHE") or
                           os.path.join(workdir, "xla_cache"))
  try:
    run(stage, workdir, progress=not args.no_progress, progress_every=args.progress_every,
        alerts=metrics_lib.Alerts(max_mean_load=args.warn_max_mean_load,
                                  dead_frac=args.warn_dead_frac, drop_rate=args.warn_drop_rate),
        allow_config_change=args.allow_config_change)
  except (NonFiniteLossError, FileNotFoundError, ValueError, WorkdirLockedError,
          UnreadableCheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return failed(1)  # a job of several processes leaves now, not at the shutdown barrier
  except KeyboardInterrupt:  # Ctrl-C before the step loop holds signals (data, state init), or
    # a second Ctrl-C: nothing is saved then; one line, not a traceback
    print(f"[{stage.name}] interrupted (SIGINT): stopped at once with nothing new saved; run "
          "the same command again to resume from the last checkpoint (or start the stage)",
          file=sys.stderr)
    return failed(130)
  except OSError as e:  # a full disk, a read-only workdir: one line, not a traceback
    message = write_failure(e, workdir)
    if message is None:
      raise
    print(f"error: {message}", file=sys.stderr)
    return failed(1)
  return 0  # a preempted run saved its state and said so; rerunning resumes it
