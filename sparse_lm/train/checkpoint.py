"""Orbax checkpoints of a training stage: state, data position, config and tokenizer.

A checkpoint at step n is one directory `<stage_dir>/checkpoints/<n>/` written by an Orbax
`CheckpointManager` (asynchronously; Orbax writes into a temporary directory and renames it when
complete, so a crash mid-save never leaves a half-written step that looks finished). Items:
  state      the TrainState (params, balancer buffers and other model variables, optimizer
             state, step, RNG), restored into an abstract target that carries shardings, so a
             checkpoint written on one device layout restores onto another;
  data       the training iterator's state (JSON) so a resumed run sees exactly the same data;
  meta       the stage config, the tokenizer (its JSON and fingerprint), `final` on the last save.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Any

import jax
import optax
import orbax.checkpoint as ocp

from sparse_lm.train.state import TrainState


class TokenizerMismatchError(ValueError):
  """Resuming or initialising with a tokenizer other than the checkpoint's."""


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `abstract_state` carrying `shardings` (same tree)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_state, shardings)


class Checkpointer:
  """Saves and restores one stage's checkpoints (keeps the last `keep`)."""

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
    self.directory = pathlib.Path(directory).absolute()
    self._mgr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=async_save))

  def all_steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  def save(self, state: TrainState, *, data_state: dict | None, meta: dict[str, Any],
           final: bool = False) -> int:
    """Start an (asynchronous) save of `state` at its step; returns the step."""
    step = int(jax.device_get(state.step))
    if step in self._mgr.all_steps():
      return step  # already saved (e.g. the periodic save coincides with the final one)
    self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state or {}),
        meta=ocp.args.JsonSave({**meta, "final": final, "step": step})))
    return step

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()

  def read_meta(self, step: int) -> dict[str, Any]:
    return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore_latest(self, abstract_state: Any) -> tuple[TrainState, dict, dict] | None:
    """(state, data_state, meta) of the newest readable checkpoint, or None if there is none.

    `abstract_state` is a tree of `jax.ShapeDtypeStruct`s with shardings. An unreadable
    (truncated, corrupt) checkpoint is skipped with a warning and the previous one is tried.

    Raises:
      RuntimeError: checkpoints exist but none of them can be read.
    """
    steps = sorted(self._mgr.all_steps(), reverse=True)
    errors = []
    for step in steps:
      try:
        restored = self._mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        return restored.state, dict(restored.data or {}), dict(restored.meta)
      except Exception as e:  # pylint: disable=broad-except  (any read failure means corrupt)
        msg = (f"checkpoint {self.directory / str(step)} cannot be restored "
               f"({type(e).__name__}: {str(e)[:300]}); falling back to the previous one")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        errors.append(msg)
    if steps:
      raise RuntimeError(f"no readable checkpoint in {self.directory}:\n" + "\n".join(errors))
    return None


def check_tokenizer(meta: dict[str, Any], fingerprint: str, where: str) -> None:
  """Raise TokenizerMismatchError if the checkpoint was written with another tokenizer."""
  saved = (meta.get("tokenizer") or {}).get("fingerprint")
  if saved is not None and saved != fingerprint:
    raise TokenizerMismatchError(
        f"{where} was written with tokenizer {saved}, but this run uses {fingerprint}. "
        "Use the same tokenizer (the one cached in the workdir) or start a new workdir.")


def reset_schedule_count(opt_state: optax.OptState) -> optax.OptState:
  """Zero the learning-rate schedule's step counter (a new stage re-warms up).

  Adam's own count (bias correction of the kept moments) is left as it is.
  """
  def reset(x):
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=x.count * 0)
    return x
  return jax.tree.map(reset, opt_state,
                      is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
