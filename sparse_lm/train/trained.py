"""`load(workdir, stage=None) -> (model, tokenizer, stage_config)`: a trained model in one call.

  from sparse_lm.train import load
  model, tokenizer, stage = load("runs/tiny")            # the newest stage in the workdir
  ids = [tokenizer.bos_id] + tokenizer.encode("def ")    # <bos> first, as in training
  logits = model(jnp.asarray([ids]))                     # [1, T, vocab] fp32, train=False

The stage config and the tokenizer come from the checkpoint itself (what the run saved), so
the model is the one that was trained whatever the stage files say today.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

import jax
from flax import nnx

from sparse_lm import sharding as shd
from sparse_lm.data import Tokenizer
from sparse_lm.train.builder import build
from sparse_lm.train.checkpoint import Checkpointer, stage_from_json
from sparse_lm.train.config import StageConfig


def _stage_dirs(workdir: pathlib.Path) -> list[pathlib.Path]:
  """Stage directories of `workdir` that hold checkpoints, newest checkpoint last."""
  found = []
  for ckpt_dir in workdir.glob("*/checkpoints"):
    steps = [p for p in ckpt_dir.iterdir() if p.name.isdigit()]
    if steps:
      found.append((max(p.stat().st_mtime for p in steps), ckpt_dir.parent))
  return [d for _, d in sorted(found)]


class NotAStageError(ValueError):
  """The checkpoints are not a pretraining stage's (an RL phase's: no stage config); `meta` is
  the newest step's, `stage_dir` the directory holding them (`<workdir>/<name>`)."""

  def __init__(self, message: str, meta: dict, stage_dir: pathlib.Path):
    super().__init__(message)
    self.meta = meta
    self.stage_dir = stage_dir


def _refuse_other_runs(ckpt: Checkpointer, stage_dir: pathlib.Path) -> None:
  """Raise NotAStageError when the newest step's meta has no stage config (an RL phase's
  checkpoints, `sparse_lm.rl.trainer`); a meta that cannot be read is left to the restore."""
  steps = ckpt.all_steps()
  try:
    meta = ckpt.read_meta(steps[-1]) if steps else {}
  except Exception:  # pylint: disable=broad-except  (corrupt: restore_latest reports it)
    return
  if meta and "stage" not in meta:
    ckpt.close()
    what = f"an RL phase's ({meta['phase']!r})" if "phase" in meta else "another run's"
    raise NotAStageError(
        f"{stage_dir}: its checkpoints are {what}, not a pretraining stage's: generate "
        f"from them with `python -m sparse_lm.generate --workdir {stage_dir.parent} --stage "
        f"{stage_dir.name}`, or load one step with `sparse_lm.generate.load_checkpoint("
        f"'{stage_dir / 'checkpoints'}/<step>')`", meta, stage_dir)


def load(workdir: str | pathlib.Path, stage: str | None = None, *,
         devices: Sequence[jax.Device] | None = None
         ) -> tuple[nnx.Module, Tokenizer, StageConfig]:
  """The model of a stage's newest readable checkpoint, its tokenizer and its stage config.

  Args:
    workdir: the run directory (`--workdir` of `python -m experiments.stage_*`).
    stage: the stage's name (e.g. "stage_8k"); None = the stage whose newest checkpoint is
      the most recent in the workdir.
    devices: where the parameters live (default all devices; sharded over them along `fsdp`).

  Returns:
    (model, tokenizer, stage_config): the `Transformer` with its trained parameters and
    balancer biases (call it with `train=False`, the default), the run's `Tokenizer`, and the
    `StageConfig` saved with the step restored (when the newest step cannot be read and an
    older one is restored, with a RuntimeWarning naming both, the older step's config).

  Raises:
    FileNotFoundError: no checkpoint of `stage` (or of any stage) in `workdir`; the message
      lists the stages there.
    UnreadableCheckpointError (a RuntimeError): checkpoints exist but none can be read (the
      message names each step and why).
    NotAStageError (a ValueError): the stage's checkpoints are an RL phase's (no stage
      config); the message says how to load them.
  """
  workdir = pathlib.Path(workdir).absolute()
  stages = _stage_dirs(workdir) if workdir.is_dir() else []
  names = [d.name for d in stages]
  if stage is None and stages:
    stage = names[-1]
  if stage not in names:
    if (workdir / "checkpoints").is_dir():  # a stage's directory, not the workdir above it
      raise FileNotFoundError(
          f"{workdir} is a stage directory: load it with load({str(workdir.parent)!r}, "
          f"stage={workdir.name!r})")
    from sparse_lm.interop import workdir as hf_import  # pylint: disable=g-import-not-at-top
    imported = stage is None and not names and hf_import.imported_config(workdir) is not None
    raise FileNotFoundError(
        f"no checkpoint of {stage or 'any stage'} in {workdir} (stages with checkpoints: "
        f"{names or 'none'}); " + (
            "it holds an HF import (`python -m sparse_lm.interop.hf import`): load that with "
            "`sparse_lm.interop.workdir.load_from_workdir`, generate from it with `python -m "
            f"sparse_lm.generate --workdir {workdir}`, or fine-tune it with `python -m "
            f"experiments.<stage> --set init_from={workdir} --workdir=<new dir>`" if imported else
            f"train one with `python -m experiments.{stage or '<stage>'} "
            f"--workdir={workdir}`"))
  ckpt = Checkpointer(workdir / stage / "checkpoints", keep=10**6)
  _refuse_other_runs(ckpt, workdir / stage)
  mesh = shd.make_mesh(shd.MeshLayout(), devices)

  def target_for(meta):
    # Each step is restored as the stage config saved with it: a stage resumed with
    # --allow-config-change may have changed its optimizer (another opt-state tree) between
    # steps, and the config returned must be the restored step's, not the newest step's.
    parts = build(stage_from_json(meta["stage"]), mesh)
    return shd.with_shardings(parts.abstract_state, parts.state_shardings)

  try:
    with shd.use_mesh(mesh):
      restored = ckpt.restore_latest(target_for, set_aside=False)
  finally:
    ckpt.close()
  if restored is None:  # the steps were removed since they were listed
    raise FileNotFoundError(f"no checkpoint of {stage} in {workdir}: {ckpt.directory} is empty")
  state, _, meta = restored
  stage_cfg = stage_from_json(meta["stage"])  # the restored step's (restore_latest's meta)
  parts = build(stage_cfg, mesh)  # cached: the build `target_for` made for this step
  model = nnx.merge(parts.graphdef, state.params, state.model_vars)
  return model, Tokenizer.from_json(meta["tokenizer"]["json"]), stage_cfg
