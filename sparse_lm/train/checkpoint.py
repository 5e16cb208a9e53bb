"""Orbax checkpoints of a training stage: state, data position, config and tokenizer.

A checkpoint at step n is one directory `<stage_dir>/checkpoints/<n>/` written by an Orbax
`CheckpointManager` (asynchronously; Orbax writes into a temporary directory and renames it when
complete, so a crash mid-save never leaves a half-written step that looks finished). Items:
  state      the TrainState (params, balancer buffers and other model variables, optimizer
             state, step, RNG), restored into an abstract target that carries shardings, so a
             checkpoint written on one device layout restores onto another;
  data       the training iterator's state (JSON) so a resumed run sees exactly the same data;
  meta       the stage config, the model config, the tokenizer (its JSON and fingerprint),
             `final` on the last save.

A checkpoint that cannot be read is moved aside to `<stage_dir>/unreadable_checkpoints/` once an
older one has restored (so the step can be saved again); one whose model config differs from
the run's is not corruption: `check_meta` stops before anything is read or moved.
The data item holds the position of every row group of the batch (`data_item`, `shard_state`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import sys
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from sparse_lm.config import PRESETS, ModelConfig
from sparse_lm.data import DataConfig
from sparse_lm.interop.workdir import read_failure  # re-exported: generate, tests
from sparse_lm.sharding import MeshLayout
from sparse_lm.train.config import StageConfig
from sparse_lm.train.optimizer import OptimizerConfig
from sparse_lm.train.state import TrainState

UNREADABLE_DIR = "unreadable_checkpoints"


class TokenizerMismatchError(ValueError):
  """Resuming or initialising with a tokenizer other than the checkpoint's."""


class UnreadableCheckpointError(RuntimeError):
  """Checkpoints exist but none of them can be read (truncated, corrupt); the message names
  each with its error. Nothing was moved."""


class ConfigMismatchError(ValueError):
  """Resuming with a model or stage config other than the checkpoint's (not corruption)."""


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
    """The steps of the checkpoints in the directory, ascending."""
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
    """Block until every started save is written and committed."""
    self._mgr.wait_until_finished()

  def close(self) -> None:
    """Wait for the started saves, then release the manager (no save after this)."""
    self._mgr.wait_until_finished()
    self._mgr.close()

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata saved with checkpoint `step` (no arrays are read)."""
    return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore_latest(self, abstract_state: Any | Callable[[dict[str, Any]], Any],
                     check_meta: Callable[[dict[str, Any]], None] | None = None, *,
                     set_aside: bool = True) -> tuple[TrainState, dict, dict] | None:
    """(state, data_state, meta) of the newest readable checkpoint, or None if there is none;
    `meta` is the one saved with the step restored.

    `abstract_state` is a tree of `jax.ShapeDtypeStruct`s with shardings, or a function of a
    checkpoint's meta returning that step's tree (called after `check_meta`, for each step
    tried: a reader that restores each step as the config saved with it, `sparse_lm.train.load`;
    with `set_aside=False` what it raises counts as that step's read failure, else it stops
    the search: a trainer's checkpoint is moved aside only for its files). `check_meta(meta)` is
    called with a checkpoint's meta before its arrays are read; what it raises (e.g.
    ConfigMismatchError) stops the search at once. An unreadable (truncated, corrupt)
    checkpoint is skipped with a warning and the previous one is tried; once an older one
    restores, the unreadable ones are moved to `<stage_dir>/unreadable_checkpoints/` so that
    their step numbers are saved again (nothing is moved when none can be read, or with
    `set_aside=False`, as a reader that does not train uses).

    Raises:
      UnreadableCheckpointError: checkpoints exist but none of them can be read.
    """
    steps = sorted(self._mgr.all_steps(), reverse=True)
    if steps:  # before any read: a failed read's others can report before its error is caught
      quiet_abandoned_reads()
    errors, unreadable = [], []
    for i, step in enumerate(steps):
      try:
        meta = dict(self.read_meta(step))
      except Exception as e:  # pylint: disable=broad-except  (an unreadable meta is corrupt)
        meta, failure = None, e
      if meta is not None:
        if check_meta is not None:
          check_meta(meta)
        target = abstract_state
        if callable(target) and set_aside:
          # A trainer's target builder failing is no sign of damaged files: it stops the
          # search, so that a readable checkpoint is never moved aside for it.
          target = target(meta)
        try:
          if callable(target):
            target = target(meta)
          restored = self._mgr.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
          if set_aside:
            self._set_aside(unreadable)
          return restored.state, dict(restored.data or {}), meta
        except Exception as e:  # pylint: disable=broad-except  (any read failure: corrupt)
          failure = e
      msg = (f"checkpoint {self.directory / str(step)} cannot be restored "
             f"({read_failure(failure)}); "
             + ("falling back to the previous one" if i + 1 < len(steps) else
                "no older checkpoint"))
      warnings.warn(msg, RuntimeWarning, stacklevel=2)
      errors.append(msg)
      unreadable.append(step)
    if steps:
      raise UnreadableCheckpointError(
          f"no readable checkpoint in {self.directory} (nothing was moved):\n"
          + "\n".join(errors) + f"\nIf the storage is fine, move {self.directory} aside to "
          "start this stage over.")
    return None

  def _set_aside(self, steps: list[int]) -> None:
    """Move the unreadable `steps` out of the manager's directory (primary process)."""
    if not steps:
      return
    if jax.process_index() == 0:
      aside = self.directory.parent / UNREADABLE_DIR
      aside.mkdir(parents=True, exist_ok=True)
      stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
      for step in steps:
        target = aside / f"{step}-{stamp}"
        shutil.move(str(self.directory / str(step)), str(target))
        warnings.warn(f"moved the unreadable checkpoint {self.directory / str(step)} to "
                      f"{target}; step {step} will be saved again", RuntimeWarning,
                      stacklevel=3)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("sparse_lm checkpoint set aside")
    self._mgr.reload()


class _AbandonedReadFilter(logging.Filter):
  """Drops asyncio's "... exception was never retrieved" records of checkpoint reads."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    if "never retrieved" not in text:
      return True
    if any(k in text for k in _READ_MARKS):
      return False
    # The message may name only the error (a JSONDecodeError of a half-read metadata file,
    # CI 2026-12-07): then the traceback's frames tell whether orbax or TensorStore raised it.
    err = record.exc_info[1] if record.exc_info else None
    tb = getattr(err, "__traceback__", None)
    while tb is not None:
      if any(k in tb.tb_frame.f_code.co_filename for k in _READ_FILES):
        return False
      tb = tb.tb_next
    return True


_READ_MARKS = ("orbax", "tensorstore", "OCDBT")
_READ_FILES = ("orbax", "tensorstore")  # in the source path of a frame that raised
_QUIET = []


def quiet_abandoned_reads() -> None:
  """Silence the late errors of a failed restore's other reads, for the rest of the process.
  Installed before the first read of `Checkpointer.restore_latest` (installed only once a
  read had failed, the first reads to report could come before it: 2 of 4 runs of the test's
  script printed tracebacks, 2026-12-06).

  When one array of a checkpoint cannot be read, orbax's restore raises while its other
  reads (one per array) are still in flight; as they finish, each reports into an event loop
  already closed, and asyncio logs each failed one: thousands of tracebacks for one
  corrupt checkpoint of a real model, burying the one warning that says what happened. This
  drops exactly those (`RuntimeError('Event loop is closed')` raised where no one can catch
  it, and asyncio's never-retrieved records that name orbax or TensorStore); other
  unraisable exceptions and log records pass through. Installed once.
  """
  if _QUIET:
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    err = unraisable.exc_value
    if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
      return
    previous(unraisable)

  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(_AbandonedReadFilter())
  _QUIET.append(hook)


def check_tokenizer(meta: dict[str, Any], fingerprint: str, where: str,
                    source: str | None = None) -> None:
  """Raise TokenizerMismatchError if the checkpoint was written with another tokenizer.

  `source`: this run's data.source; the message names it beside the one the checkpoint's run
  trained on (a tokenizer is trained from the data source unless data.tokenizer names one, so
  a stage run without the earlier stage's `--set data.source=...` gets another tokenizer)."""
  saved = (meta.get("tokenizer") or {}).get("fingerprint")
  if saved is not None and saved != fingerprint:
    stage = meta.get("stage")
    data = stage.get("data") or {} if isinstance(stage, dict) else {}
    then, then_tok = data.get("source"), data.get("tokenizer")
    hint = ""
    if then is not None and source is not None and then != source:
      hint = (f" The checkpoint's run read data.source={then!r}, this one {source!r}: data "
              "overrides are per command, so give the earlier run's again (--set "
              f"data.source={then})")
      hint += (f" or its tokenizer (--set data.tokenizer={then_tok})." if then_tok else
               ", or name its tokenizer file (--set data.tokenizer=PATH).")
    raise TokenizerMismatchError(
        f"{where} was written with tokenizer {saved}, but this run uses {fingerprint}.{hint} "
        "Use the same tokenizer (the one cached in the workdir) or start a new workdir.")


def reset_schedule_count(opt_state: optax.OptState) -> optax.OptState:
  """Zero the learning-rate schedule's step counter (a new stage re-warms up).

  Adam's own count (bias correction of the kept moments) is left as it is.
  """
  return set_schedule_count(opt_state, 0)


def set_schedule_count(opt_state: optax.OptState, count) -> optax.OptState:
  """The learning-rate schedule's step counter (every `optax.ScaleByScheduleState` in the
  tree) set to `count` (an int or int32 scalar), keeping its dtype; other counters (Adam's
  bias correction) are left as they are. A fresh optimizer state for a run resumed at step
  `count` takes it so that the schedule goes on where the run was."""
  def put(x):
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=jnp.zeros_like(x.count) + jnp.asarray(count, x.count.dtype))
    return x
  return jax.tree.map(put, opt_state,
                      is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))


# -- the stage config in a checkpoint's meta ----------------------------------------------------

def to_json(x: Any) -> Any:
  """`x` (dataclasses, tuples, ...) as plain JSON values (tuples become lists)."""
  if dataclasses.is_dataclass(x):
    x = dataclasses.asdict(x)
  return json.loads(json.dumps(x, default=str))


_NESTED = {"optim": OptimizerConfig, "data": DataConfig, "mesh": MeshLayout}


def stage_from_json(d: dict[str, Any]) -> StageConfig:
  """The StageConfig saved as `to_json(stage)` in a checkpoint's meta (unknown keys, e.g.
  fields removed since, are dropped)."""
  def build(cls, values):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})
  kwargs = dict(d)
  for key, cls in _NESTED.items():
    if isinstance(kwargs.get(key), dict):
      kwargs[key] = build(cls, kwargs[key])
  kwargs["model_overrides"] = tuple(
      (k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.get("model_overrides", ()))
  return build(StageConfig, kwargs)


def make_meta(stage: StageConfig, tokenizer_fingerprint: str, tokenizer_json: str
              ) -> dict[str, Any]:
  """What every checkpoint of `stage` records besides its step: configs and the tokenizer."""
  return {"stage": to_json(stage), "model": to_json(stage.model_config()),
          "tokenizer": {"fingerprint": tokenizer_fingerprint, "json": tokenizer_json}}


def saved_model_config(meta: dict[str, Any]) -> dict[str, Any] | None:
  """The model config a checkpoint was written with, as JSON (None if unknown)."""
  if meta.get("model"):
    return meta["model"]
  if meta.get("stage"):
    try:
      return to_json(stage_from_json(meta["stage"]).model_config())
    except (TypeError, ValueError):
      return None
  return None


def differences(saved: Any, current: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
  """{dotted key: (saved, current)} for every leaf of two JSON trees that differs (keys that
  only one side has, i.e. fields added or removed since the save, are not compared)."""
  if isinstance(saved, dict) and isinstance(current, dict):
    out = {}
    for k in sorted(set(saved) & set(current)):
      out.update(differences(saved[k], current[k], f"{prefix}{k}."))
    return out
  return {} if saved == current else {prefix.rstrip("."): (saved, current)}


# StageConfig fields whose change on resume leaves the optimisation as it was (reporting,
# layout, and what matters only at a stage's start); any other difference changes it.
RESUMABLE_CHANGES = ("name", "eval_every", "eval_batches", "eval_batch_size",
                     "checkpoint_every", "keep_checkpoints", "mesh", "topology",
                     "num_slices",
                     "micro_batches", "init_from", "keep_optimizer_state", "sample_tokens",
                     "sample_prompt", "reference_seq_len", "nan_at_step", "data.prefetch",
                     "gpu_autotune", "gc_every")


# ModelConfig fields that choose an implementation, not the parameters or the function they
# compute: a checkpoint resumes under other values (e.g. another remat policy to fit memory).
MODEL_RUNTIME_FIELDS = ("name", "ep_exchange", "kda_backend", "kda_chunk_size", "attention_backend",
                        "attention_chunk_size", "gmm_backend", "remat_policy",
                        "remat_skip_last", "lm_head_grad_dtype",
                        "loss_chunk_size", "init_std", "vision_prefix_buckets")


def check_model(meta: dict[str, Any], model_cfg: ModelConfig, name: str
                ) -> dict[str, tuple[Any, Any]]:
  """Raise ConfigMismatchError if the checkpoint's model config differs from `model_cfg`
  outside MODEL_RUNTIME_FIELDS; returns the runtime-field changes {"model.x": (saved, now)}."""
  saved_model = saved_model_config(meta)
  if saved_model is None:
    return {}
  diff = differences(saved_model, to_json(model_cfg))
  notes = {f"model.{k}": v for k, v in diff.items() if k in MODEL_RUNTIME_FIELDS}
  diff = {k: v for k, v in diff.items() if k not in MODEL_RUNTIME_FIELDS}
  if diff:
    head = ""
    saved_preset = (meta.get("stage") or {}).get("preset")
    if saved_preset in PRESETS and model_cfg.name in PRESETS and saved_preset != model_cfg.name:
      head = (f"the checkpoint holds a {saved_preset!r} model and this run builds "
              f"{model_cfg.name!r} (--preset={saved_preset} resumes it); ")
    raise ConfigMismatchError(
        f"[{name}] {head}the model config differs from the checkpoint at step "
        f"{meta.get('step')}: " + listing(diff) + ". A checkpoint cannot be resumed as "
        "another model: use a new workdir (--workdir=...), or run with the checkpoint's model "
        "settings.")
  return notes


def check_resume(meta: dict[str, Any], stage: StageConfig, *,
                 allow_config_change: bool = False) -> list[str]:
  """Compare the configs a checkpoint was written with to this run's.

  Returns the changes that leave the optimisation as it was ("field: saved -> now"), for the
  run to print.

  Raises:
    ConfigMismatchError: the model config differs outside MODEL_RUNTIME_FIELDS (whatever
      `allow_config_change`: the checkpoint is another model); or the stage config differs in
      a field that changes the optimisation (steps, schedule, batch, data, loss) and
      `allow_config_change` is False.
  """
  model_notes = check_model(meta, stage.model_config(), stage.name)
  if not meta.get("stage"):
    return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in model_notes.items()]
  where = f"the checkpoint at step {meta.get('step')}"
  diff = differences(meta["stage"], to_json(stage))
  diff = {k: v for k, v in diff.items()
          if not k.startswith("model_overrides") and k != "preset"}  # compared above
  benign = {k: v for k, v in diff.items()
            if any(k == f or k.startswith(f + ".") for f in RESUMABLE_CHANGES)}
  blocking = {k: v for k, v in diff.items() if k not in benign}
  if blocking and not allow_config_change:
    raise ConfigMismatchError(
        f"[{stage.name}] resuming from {where} with a stage config that changes the "
        "optimisation: " + listing(blocking) + ". Run with the saved settings to resume "
        "as it was, pass --allow-config-change (run(..., allow_config_change=True)) to "
        "continue with the new ones, or use a new workdir to start afresh.")
  changes = {**blocking, **benign, **model_notes}
  return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()]


def listing(diff: dict[str, tuple[Any, Any]]) -> str:
  """`differences`' result as "key: saved (saved) vs current (now); ..." for an error message."""
  return "; ".join(f"{k}: {a!r} (saved) vs {b!r} (now)" for k, (a, b) in diff.items())


# -- the data item: every row group's iterator position ---------------------------------------

def data_item(state: dict, shard: int) -> dict:
  """{"shards": {row group: its data-iterator state}} from every process (the checkpoint's
  JSON item is written by the primary process only, so it must hold every row group's
  position; processes of one row group hold equal states)."""
  if jax.process_count() == 1:
    return {"shards": {str(shard): state}}
  blob = np.frombuffer(json.dumps(state).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([blob.size], np.int32)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:blob.size] = blob
  blobs = np.asarray(multihost_utils.process_allgather(padded))
  shards = np.asarray(multihost_utils.process_allgather(np.array([shard], np.int32)))
  return {"shards": {str(int(shards[i].reshape(-1)[0])): json.loads(
      bytes(blobs[i][:int(sizes[i].reshape(-1)[0])]).decode()) for i in range(len(blobs))}}


def shard_state(data_state: dict | None, shard: int) -> dict | None:
  """This row group's iterator state from a checkpoint's data item (None: start fresh).

  Raises:
    ValueError: the checkpoint has no position for this row group (written with another
      number of row groups, i.e. another mesh or batch over hosts).
  """
  if not data_state:
    return None
  if "shards" not in data_state:  # written before the per-row-group format: one process
    return data_state
  if str(shard) not in data_state["shards"]:
    raise ValueError(
        f"the checkpoint's data position has row groups {sorted(data_state['shards'])}, not "
        f"{shard}: it was written with another split of the batch over hosts; resume with the "
        "same mesh and batch, or start the data stream afresh from a new workdir")
  return data_state["shards"][str(shard)]
