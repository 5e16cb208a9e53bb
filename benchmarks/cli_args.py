"""Argument parsing shared by the benchmark scripts."""

from __future__ import annotations


def parse_model_sets(items: list[str]) -> dict:
  """--set FIELD=VALUE items -> ModelConfig overrides, each value parsed to its field's type
  (bool "false" is False, "none" is None for an optional field), as the experiments' --set.
  Raises ValueError naming the item, or the unknown field and the valid ones."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import typing  # pylint: disable=g-import-not-at-top
  from experiments.base import _parse  # pylint: disable=g-import-not-at-top
  from sparse_lm.config import ModelConfig  # pylint: disable=g-import-not-at-top
  hints = typing.get_type_hints(ModelConfig)
  fields = sorted(f.name for f in dataclasses.fields(ModelConfig))
  out = {}
  for item in items:
    k, sep, v = item.partition("=")
    k = k.strip()
    if not sep or not k:
      raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
    if k not in hints or k not in fields:
      raise ValueError(f"--set {item!r}: unknown ModelConfig field {k!r}; valid: {fields}")
    tp, args = hints[k], typing.get_args(hints[k])
    if type(None) in args:  # Optional[X]: "none" or an X (one error message, not two)
      if v.strip().lower() in ("none", "null"):
        out[k] = None
        continue
      rest = [a for a in args if a is not type(None)]
      tp = rest[0] if len(rest) == 1 else tp
    out[k] = _parse(v, tp, k)
  return out


def stage_preset(parser, stage: str, preset: str):
  """The StageConfig `experiments.<stage>.STAGES[preset]`, or `parser.error` (exit 2) naming
  --stage or --preset and what they may be."""
  import importlib  # pylint: disable=g-import-not-at-top
  try:
    module = importlib.import_module(f"experiments.{stage}")
  except ModuleNotFoundError as e:
    if e.name != f"experiments.{stage}":
      raise
    parser.error(f"--stage {stage!r}: no module experiments.{stage} (e.g. stage_8k)")
  stages = getattr(module, "STAGES", None)
  if not isinstance(stages, dict):
    parser.error(f"--stage {stage!r}: experiments.{stage} is not a pretraining stage (no "
                 "STAGES presets; e.g. stage_8k, stage_64k, stage_256k, stage_1m)")
  if preset not in stages:
    parser.error(f"--preset {preset!r}: expected one of {', '.join(stages)}")
  return stages[preset]
