"""Agentic RL: SFT warm-up on tool-use transcripts, then GRPO (docs/rl.md).

  python -m experiments.agentic_rl --preset=tiny [--init_from=runs/tiny] [--workdir=runs/rl_tiny]
      [--env=arithmetic] [--seed=0] [--set grpo_steps=40 --set grpo.kl_coef=0.01] [--list-keys]

tiny  the calculator task on CPU: a 9-layer d_model=64 model learns the call format from 125
      SFT steps of 64 transcripts (stopped while it is still learning to copy numbers: held-out
      success about 0.5: 0.47-0.52 over the 3 seeds run from scratch in docs/rl.md), then 40 GRPO steps of 16 prompts x 8 episodes sampled at temperature 0.3,
      AdamW lr 1e-3 (held-out greedy eval on 256 tasks after SFT and every 10 GRPO steps).
small the same loop on one GPU with long episodes: the pass-key task in 64K characters of the
      standard library's sources (the document grows with the stage's length).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import sys
from typing import Any

from sparse_lm.rl.grpo import GRPOConfig
from sparse_lm.rl.trainer import (NotAnRLWorkdirError, RLConfig, check_rl_workdir,
                                  pretraining_stages)
from sparse_lm.train.optimizer import OptimizerConfig
from sparse_lm.train.workdir import local_workdir

PRESETS = {
    # SFT: 125 steps x 64 transcripts padded to 32 tokens at a constant lr after warmup
    # (held-out greedy success about 0.5 in docs/rl.md's runs: room for GRPO; 160 steps reach ~0.9); GRPO: 40 steps x
    # 16 prompts x 8 episodes at temperature 0.3, AdamW lr 1e-3, partial credit. The 3-seed
    # result is in docs/rl.md (fifth session).
    "tiny": RLConfig(preset="tiny", env="arithmetic", seq_len=64, max_turn_tokens=24,
                     sft_seq_len=32, sft_steps=125, sft_batch=64, partial_credit=0.2,
                     sft_optim=OptimizerConfig(peak_lr=3e-3, warmup_steps=20,
                                               decay_fraction=0.0, weight_decay=0.0),
                     grpo_steps=40, prompts_per_step=16,
                     grpo=GRPOConfig(group_size=8, temperature=0.3), eval_every=10,
                     grpo_optim=OptimizerConfig(peak_lr=1e-3, warmup_steps=3,
                                                decay_fraction=0.0, weight_decay=0.0)),
    "small": RLConfig(preset="small", env="passkey", env_overrides=(("doc_chars", 65_536),),
                      seq_len=1024, max_turn_tokens=64, sft_steps=500, sft_batch=64,
                      grpo_steps=200, prompts_per_step=16, grpo=GRPOConfig(group_size=16),
                      sft_optim=OptimizerConfig(peak_lr=1e-3, warmup_steps=50,
                                                weight_decay=0.0)),
}
_NESTED = {"grpo": GRPOConfig, "sft_optim": OptimizerConfig, "grpo_optim": OptimizerConfig}


def _typed(key: str, text: str, value, current):
  """value (parsed from text) as the type of the field's current value: an int or a float
  where the preset has a number, true/false where it has a bool, the text where it has a
  string, ((name, value), ...) where it has a tuple (model_overrides, env_overrides: a JSON
  list of [name, value] pairs or a JSON object); fields whose preset value is None take the
  parsed value as it is. Raises ValueError naming the key, the value and the form wanted."""
  def bad(kind):
    return ValueError(f"--set {key}={text!r} must be {kind} (the preset has {current!r})")
  if isinstance(current, tuple):
    if isinstance(value, dict):
      value = list(value.items())
    if not (isinstance(value, list) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in value)):
      raise bad(f"a JSON list of [name, value] pairs, e.g. {key}='[[\"name\", 1]]' (or a "
                "JSON object)")
    return tuple((name, v) for name, v in value)
  if isinstance(current, bool):
    if not isinstance(value, bool):
      raise bad("true or false")
    return value
  if isinstance(current, int):
    if isinstance(value, bool) or not isinstance(value, int):
      raise bad("an integer")
    return value
  if isinstance(current, float):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise bad("a number")
    return float(value)
  if isinstance(current, str):
    return text
  if dataclasses.is_dataclass(current):
    raise ValueError(f"--set {key}={text!r}: {key} is a group of settings; set its fields one "
                     f"by one, e.g. --set {key}.{dataclasses.fields(current)[0].name}=VALUE "
                     f"(fields: {[f.name for f in dataclasses.fields(current)]})")
  return value


def _typed_optional(key: str, text: str, value, hint: str):
  """A field whose preset value is None, or null for a field that may be None (`hint`: its
  annotation, e.g. "str | None"): null, or a value of the annotation's other type. Raises ValueError naming the key and the type."""
  if value is None:
    return None
  if "str" in hint:
    return text
  if "int" in hint and (isinstance(value, bool) or not isinstance(value, int)):
    raise ValueError(f"--set {key}={text!r} must be an integer or null")
  return value


def _check_model_overrides(pairs) -> tuple:
  """model_overrides as ((name, value), ...) with each name a ModelConfig field and each value
  parsed to the field's type (a string "5" for an int field is taken as 5). Raises ValueError
  naming the field, the nearest valid names or the wanted type."""
  import typing  # pylint: disable=import-outside-toplevel
  from experiments.base import _parse  # pylint: disable=import-outside-toplevel
  from sparse_lm.config import ModelConfig  # pylint: disable=import-outside-toplevel
  hints = typing.get_type_hints(ModelConfig)
  out = []
  for name, value in pairs:
    if name not in hints:
      near = difflib.get_close_matches(name, list(hints), n=3, cutoff=0.6)
      raise ValueError(f"model_overrides: unknown ModelConfig field {name!r}"
                       + (f"; did you mean {', '.join(near)}?" if near else ""))
    text = value if isinstance(value, str) else json.dumps(value)
    out.append((name, _parse(text, hints[name], f"model_overrides.{name}")))
  return tuple(out)


def apply_sets(cfg: RLConfig, sets: list[str]) -> RLConfig:
  """`cfg` with each "field=value" (or "grpo.field=value", "sft_optim.field=value", ...)
  replaced; values parse as JSON (numbers, true/false, null, lists) and must have the type of
  the preset's value (`_typed`). "env=X" drops the preset's env_overrides as --env X does
  (`with_env`). Raises ValueError naming an unknown field or a value of the wrong type."""
  top, nested = {}, {k: {} for k in _NESTED}
  for item in sets:
    key, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"--set expects field=value, got {item!r}")
    try:
      value = json.loads(text)
    except json.JSONDecodeError:
      value = text
    prefix, _, field = key.partition(".")
    cls = _NESTED.get(prefix) if field else RLConfig
    names = {f.name for f in dataclasses.fields(cls)} if cls else set()
    if (field or key) not in names:
      near = nearest_keys(key)
      guess = f"did you mean {', '.join(near)}? " if near else ""
      tail = "; --list-keys prints every key with the preset's value"
      if cls is not None and field:  # a typo inside a group: that group's fields
        raise ValueError(f"unknown --set key {key!r}; {prefix}.<field> is one of "
                         f"{[f.name for f in dataclasses.fields(cls)]}"
                         + (f"; {guess.strip()}" if near else "") + tail)
      raise ValueError(f"unknown --set key {key!r}; {guess}RLConfig fields: "
                       f"{[f.name for f in dataclasses.fields(RLConfig)]}, nested: "
                       f"{sorted(_NESTED)}.<field>{tail}")
    current = getattr(getattr(cfg, prefix) if field else cfg, field or key)
    hint = str({f.name: f.type for f in dataclasses.fields(cls)}[field or key])
    if current is None or (value is None and "None" in hint):
      typed = _typed_optional(key, text, value, hint)
    else:
      typed = _typed(key, text, value, current)
    if key == "model_overrides":
      typed = _check_model_overrides(typed)
    (nested[prefix] if field else top)[field or key] = typed
  for prefix, changes in nested.items():
    if changes:
      top[prefix] = dataclasses.replace(getattr(cfg, prefix), **changes)
  if "env" in top:  # as --env: a --set env_overrides applies on top
    cfg = with_env(cfg, top.pop("env"))
  return dataclasses.replace(cfg, **top)


def valid_keys(cfg: RLConfig) -> list[tuple[str, Any]]:
  """Every (key, value) `--set` accepts for `cfg`: RLConfig's fields, and `<group>.<field>` for
  the nested groups (grpo, sft_optim, grpo_optim) instead of the groups themselves."""
  out = []
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if f.name in _NESTED:
      out += [(f"{f.name}.{g.name}", getattr(value, g.name)) for g in dataclasses.fields(value)]
    else:
      out.append((f.name, value))
  return out


# Names a user of other trainers types for a key of another name (found by a newcomer's
# `--set steps=...` and `--set learning_rate=...`).
_ALIASES = {"steps": ["sft_steps", "grpo_steps"],
            "lr": ["sft_optim.peak_lr", "grpo_optim.peak_lr"],
            "learning_rate": ["sft_optim.peak_lr", "grpo_optim.peak_lr"],
            "batch_size": ["sft_batch", "prompts_per_step"],
            "temperature": ["grpo.temperature"], "kl_coef": ["grpo.kl_coef"],
            "group_size": ["grpo.group_size"]}


def nearest_keys(key: str, n: int = 4) -> list[str]:
  """The valid `--set` keys closest to an unknown `key` (aliases, then spelling, then the
  same field name in another group)."""
  from experiments.base import closest_keys  # pylint: disable=import-outside-toplevel
  valid = [k for k, _ in valid_keys(PRESETS["tiny"])]
  aliases = _ALIASES.get(key.rpartition(".")[2].lower(), [])
  return closest_keys(key, valid, aliases, n=n, field_cutoff=0.8)


def _shown(value) -> str:
  """`value` as `--set` takes it: JSON (null, true, lists of pairs), a string as it is."""
  if isinstance(value, str):
    return value
  if isinstance(value, tuple):
    return json.dumps([list(p) for p in value])
  return json.dumps(value)


def with_env(cfg: RLConfig, env: str) -> RLConfig:
  """`cfg` with environment `env`; the preset's env_overrides are its own env's settings
  (the small preset's doc_chars is the passkey env's), so they are dropped when env changes."""
  if env == cfg.env:
    return cfg
  return dataclasses.replace(cfg, env=env, env_overrides=())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.agentic_rl",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  parser.add_argument("--workdir", default=None, help="default ./runs/rl_<preset>")
  parser.add_argument("--init-from", "--init_from", dest="init_from", default=None,
                      help="a pretraining workdir (runs/tiny)")
  parser.add_argument("--env", default=None, help="arithmetic, lookup, passkey or code")
  parser.add_argument("--seed", type=int, default=None)
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                      help="override a setting (repeatable), e.g. --set sft_steps=10 --set "
                      "grpo_steps=2 --set grpo.temperature=0.5; values are JSON; --list-keys "
                      "prints every key")
  parser.add_argument("--list-keys", action="store_true",
                      help="print every --set key with the preset's value, and exit")
  args = parser.parse_args(argv)
  cfg = PRESETS[args.preset]
  try:
    if args.env is not None:  # before the --sets: a --set env_overrides applies to this env
      cfg = with_env(cfg, args.env)
    cfg = apply_sets(cfg, args.sets)
    set_keys = {item.partition("=")[0] for item in args.sets}
    for name in ("env", "init_from", "seed"):  # a flag and a --set of the same field
      flag = getattr(args, name)
      if flag is not None and name in set_keys and getattr(cfg, name) != flag:
        raise ValueError(f"--{name} {flag} and --set {name}={getattr(cfg, name)} disagree; "
                         f"give only one of them")
    for name in ("init_from", "seed"):
      if getattr(args, name) is not None:
        cfg = dataclasses.replace(cfg, **{name: getattr(args, name)})
    if args.list_keys:
      for key, value in valid_keys(cfg):
        print(f"{key}={_shown(value)}")
      return 0
    cfg.validate()
    if cfg.init_from:  # before the workdir is made: a mistyped init_from leaves no directory
      local_workdir(cfg.init_from, "--init_from", existing=True)
      pretraining_stages(cfg.init_from)  # before anything runs
    check_rl_workdir(local_workdir(args.workdir or f"runs/rl_{args.preset}", create=True))
  except (ValueError, TypeError, FileNotFoundError, NotAnRLWorkdirError) as e:
    parser.error(str(e))
  import os  # pylint: disable=import-outside-toplevel
  from experiments.base import enable_compilation_cache  # pylint: disable=import-outside-toplevel
  from sparse_lm.fs import write_failure  # pylint: disable=import-outside-toplevel
  from sparse_lm.rl.trainer import Preempted, run  # pylint: disable=import-outside-toplevel
  from sparse_lm.train.checkpoint import (  # pylint: disable=import-outside-toplevel
      ConfigMismatchError, UnreadableCheckpointError)
  from sparse_lm.train.loop import NonFiniteLossError  # pylint: disable=import-outside-toplevel
  from sparse_lm.train.workdir import WorkdirLockedError  # pylint: disable=import-outside-toplevel
  workdir = args.workdir or f"runs/rl_{args.preset}"
  enable_compilation_cache(os.environ.get("SPARSE_LM_XLA_CACHE") or
                           os.path.join(workdir, "xla_cache"))
  log = functools.partial(print, flush=True)  # lines reach a redirected log at once
  try:
    out = run(cfg, workdir, log=log, progress=not args.no_progress and sys.stdout.isatty())
  except KeyboardInterrupt:  # Ctrl-C before the phases hold signals (tokenizer, model, init),
    # or a second Ctrl-C: nothing is saved then; one line, not a traceback
    print(f"{parser.prog}: interrupted (SIGINT): stopped at once with nothing new saved; run "
          "the same command again to resume from the last checkpoint (or start the run)",
          file=sys.stderr)
    return 130
  except OSError as e:  # a read-only or full workdir: one line, not a traceback (as the stages)
    if isinstance(e, FileNotFoundError) and e.errno is None:  # init_from's own message
      print(f"{parser.prog}: error: {e}", file=sys.stderr)
      return 2
    message = write_failure(e, workdir)
    if message is None:
      raise
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 1
  except ConfigMismatchError as e:  # resuming a workdir written under other settings
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    return 2
  except (UnreadableCheckpointError, WorkdirLockedError,  # corrupt; another run;
          NonFiniteLossError) as e:  # diverged: the last good checkpoint is kept
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    return 1
  except Preempted as e:  # SIGTERM / Ctrl-C: the phase saved its step; rerunning resumes it
    print(e, flush=True)
    return 0
  print(json.dumps({"sft": out["sft"], "grpo": out["grpo"]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
