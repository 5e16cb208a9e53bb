"""`run(stage, workdir)`: train one stage of the curriculum, with feedback and checkpoints.

The shape of the Flax Gemma example's loop: the mesh is made once, the state is built (or
restored) under it with explicit shardings, one jitted step with donated state runs per batch,
a checkpoint manager saves every `checkpoint_every` steps, at the end and on SIGTERM or SIGINT
(Ctrl-C; at the next step boundary, or at once while the loop waits for a batch: batches are
fetched on a worker thread, `BatchFetcher`, so a stalled data pipeline cannot keep the process
from stopping; in a job of several processes the notice goes through JAX's preemption service
and is acted on at step boundaries only, so a process stalled on data does not stop: kill such
a job, it resumes from its last checkpoint), and a metrics writer and a progress bar (or, off a terminal, a plain line
every `progress_every` steps) report as it goes. The stage directory is locked for the run.

Starting point of a stage, in order: its own latest checkpoint in `<workdir>/<stage>/`
(resume: model, optimizer, step, RNG and data position; the stage and model configs saved with
it are compared with this run's first, `checkpoint.check_resume`); else the final checkpoint of
`stage.init_from` in the same workdir (weights, balancer biases and by default the optimizer
moments; step, schedule and data restart); else a fresh initialisation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import pathlib
import queue
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from sparse_lm import data as data_lib
from sparse_lm import sharding as shd
from sparse_lm.interop import workdir as hf_import
from sparse_lm.model.params import flops_per_token
from sparse_lm.train import metrics as metrics_lib
from sparse_lm.train.builder import BATCH_KEYS, Parts, build  # pylint: disable=unused-import
from sparse_lm.train.checkpoint import (Checkpointer, ConfigMismatchError, check_model,
                                        check_resume, check_tokenizer, data_item, make_meta,
                                        reset_schedule_count, set_schedule_count,
                                        shard_state, stage_from_json, to_json)
from sparse_lm.train.config import StageConfig
from sparse_lm.train.optimizer import make_optimizer
from sparse_lm.train.precompile import Precompiler
from sparse_lm.train.sample import generate
from sparse_lm.train.state import TrainState
from sparse_lm.train.workdir import WorkdirLock, local_workdir


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/Inf loss; the last good checkpoint was kept."""


@dataclasses.dataclass
class RunResult:
  """What a stage did: per-step train losses, held-out evals and where it stopped."""

  stage: str
  start_step: int
  end_step: int
  losses: dict[int, float]
  evals: dict[int, float]
  final_eval: dict[str, float]
  sample: str
  preempted: bool
  stage_dir: pathlib.Path


class Preemption:
  """SIGTERM / SIGINT (Ctrl-C) handler: ask the loop to save and stop after the current step
  (`requested` holds the signal's name; a wait for the next batch ends at once,
  `BatchFetcher`). A second SIGINT interrupts at once
  (KeyboardInterrupt). The stage loop and the RL phases (sparse_lm/rl/trainer.py) use it,
  asking `stop_after(step)` after every step.

  In a multi-process job (`jax.process_count() > 1`) a signal reaches the processes at
  different steps (or one process only), and a process that stopped to save alone left the
  others in the next step's collectives (gloo: "collective mismatch", no checkpoint). There
  the signals are left to JAX's preemption service (`jax.distributed` turns a SIGTERM on any
  process into a notice to all), and `stop_after(step)` is
  `multihost_utils.reached_preemption_sync_point(step)`: true on every process at the same
  step, the one after the largest step any process had reached (MaxText's approach). Ctrl-C
  on one process of such a job interrupts it (no save): stop a job with SIGTERM.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)
  # JAX's sync point takes one counter per process that only increases for the process's
  # life; the RL phases (SFT, then GRPO from step 1) and successive runs restart their steps,
  # so the calls are counted here, across instances (every process makes the same calls).
  _sync_calls = 0

  def __init__(self, multiprocess: bool | None = None):
    self.requested: str | None = None  # the signal's name once one arrived
    self._previous = {}
    self.multiprocess = (jax.process_count() > 1) if multiprocess is None else multiprocess

  def __enter__(self):
    if not self.multiprocess and threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def _handle(self, signum, frame):
    del frame
    if self.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.requested = signal.Signals(signum).name

  def stop_after(self, step: int) -> str | None:
    """What stops the loop after `step` (called once per step, by every process in the same
    order), or None: the signal's name, the same on every process. In a multi-process job the
    sync point is asked with this process's count of calls (over every `Preemption`), not
    `step`, which a later phase or run may restart."""
    del step  # the loops' own counters may restart; the call count does not
    if self.multiprocess and self.requested is None:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      Preemption._sync_calls += 1
      if multihost_utils.reached_preemption_sync_point(Preemption._sync_calls):
        self.requested = "SIGTERM (the job's preemption sync point)"
    return self.requested

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)


class Interrupted(Exception):
  """A SIGTERM / SIGINT during work with nothing to save (`InterruptWork`); `signal_name`."""

  def __init__(self, signal_name: str):
    super().__init__(signal_name)
    self.signal_name = signal_name


class InterruptWork(Preemption):
  """Context manager: SIGTERM and SIGINT raise `Interrupted` in the main thread (once the
  C++ call under way returns), for work after the last save that a rerun redoes: the
  end-of-stage held-out losses and sample. (Without it, Ctrl-C there was a KeyboardInterrupt
  traceback and SIGTERM a silent death.) `Preemption`'s handlers, installed and restored the
  same way (a no-op off the main thread and in a multi-process job), but a signal stops the
  work at once instead of after a step."""

  def _handle(self, signum, frame):
    del frame
    raise Interrupted(signal.Signals(signum).name)


class BatchFetcher:
  """`next(iterator)` run on a worker thread, the caller waiting in polls of `poll` seconds so
  that a stop request (SIGTERM / SIGINT, `Preemption.requested`) is honoured while the data
  pipeline is stalled.

  Called on the main thread, a `next()` that blocks (a packer waiting for text that never
  comes, a read from a hung file system) never returns to the step loop: the signal handler
  only records the request, which the loop reads at the next step boundary, so the process
  could not be stopped gracefully. Here the main thread waits on a queue with a timeout
  (Python runs the signal handler during that wait) and checks `stop()` at each timeout; a
  batch that is ready is returned at once (one hand-over between threads, tens of
  microseconds, per step).

  `next(stop)` returns the batch, or None when `stop()` became true while waiting: that fetch
  is abandoned (its thread may stay blocked: a daemon thread, it does not keep the process
  alive) and the iterator must not be used again; `state_before` then holds the iterator's
  state from before that fetch (the position of a consistent checkpoint). The iterator's
  exceptions (StopIteration included) are raised in the caller.
  """

  def __init__(self, iterator, poll: float = 0.1):
    self._it, self.poll = iterator, poll
    # queue.Queue, not SimpleQueue: on CPython 3.11 a signal that interrupts
    # SimpleQueue.get(timeout=...) near its deadline can turn the wait into one without end
    # (the remaining time goes negative, which means "block"; reproducer in
    # tests/train/test_train_units.py), exactly the wait a stop request must end.
    self._requests: queue.Queue = queue.Queue()
    self._results: queue.Queue = queue.Queue()
    self._thread: threading.Thread | None = None
    self.state_before: Any = None
    self.abandoned = False
    self.waited = 0.0  # seconds the abandoned fetch had been waited for

  def _work(self) -> None:
    while self._requests.get():
      try:
        self._results.put((True, next(self._it)))
      except BaseException as e:  # pylint: disable=broad-except  (raised in the caller)
        self._results.put((False, e))

  def next(self, stop: Callable[[], bool]):
    if self.abandoned:
      raise RuntimeError("BatchFetcher: a fetch was abandoned; the iterator's position is "
                         "unknown, so it cannot be read again")
    if self._thread is None:
      self._thread = threading.Thread(target=self._work, name="sparse_lm-batch-fetch",
                                      daemon=True)
      self._thread.start()
    get_state = getattr(self._it, "get_state", None)  # the worker is idle: a consistent read
    self.state_before = get_state() if get_state is not None else None
    self._requests.put(True)
    t0 = time.perf_counter()
    while True:
      try:
        ok, value = self._results.get(timeout=self.poll)
      except queue.Empty:
        if stop():
          self.abandoned, self.waited = True, time.perf_counter() - t0
          return None
        continue
      if ok:
        return value
      raise value

  def close(self) -> None:
    """End the worker thread: now if idle, else (an abandoned fetch) once its `next()`
    returns, if ever (a daemon thread: it does not keep the process alive)."""
    if self._thread is not None:
      self._requests.put(False)
      if not self.abandoned:
        self._thread.join(timeout=1.0)


class _StepGC:
  """Python's cyclic garbage collector kept out of the step loop (Megatron-LM's "manual GC").

  Every step builds and drops thousands of small objects (the train state's pytree is
  flattened and rebuilt around each call), so the young generations are collected several
  times per step, and every few dozen steps a full collection walks the whole heap: the traced
  programs, the tokenizer, the data pipeline, about 590,000 objects in the tiny job, about
  470 ms each on 2 CPU cores (docs/benchmarks.md). Inside the loop (entered after the first step, when everything
  long-lived exists): what lives now is frozen (`gc.freeze`: never scanned again), automatic
  collection is off, and a full collection of what is not frozen runs every `every` steps
  (milliseconds). Leaving turns the collector back on if it was on and unfreezes, unless
  objects were frozen before entry (someone else manages the frozen generation: then it stays
  frozen; Python cannot unfreeze a part of it). Reference counting frees almost all of a
  step's garbage regardless; only reference cycles wait for the next periodic collection.
  `every` = 0 (StageConfig.gc_every): does nothing, Python's collector runs as configured.
  """

  def __init__(self, every: int = 100):
    if every < 0:
      raise ValueError(f"every={every}: must be >= 0 (0 leaves the collector as it is)")
    self.every = every
    self._enabled = None
    self._frozen_before = 0

  def __enter__(self):
    if not self.every:
      return self
    self._enabled = gc.isenabled()
    self._frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.disable()
    return self

  def step(self, done: int) -> None:
    """After `done` steps: a full collection (of the non-frozen objects) every `every` steps."""
    if self.every and done % self.every == 0:
      gc.collect()

  def __exit__(self, *exc):
    if not self.every:
      return
    if not self._frozen_before:
      gc.unfreeze()
    if self._enabled:
      gc.enable()


class _HostClock:
  """Where the training loop's wall time goes, by phase (for the end-of-loop line): "data"
  (next batch + device_put), "dispatch" (the jitted step call), "gc" (`_StepGC`'s periodic
  collection), "wait" (blocked reading the previous step's metrics: the device is behind),
  "log" (metrics, TensorBoard, progress) and "other" (evals, checkpoints)."""

  def __init__(self):
    self.laps: dict[str, list[float]] = {}
    self.steps = 0
    self.restart()

  def restart(self) -> None:
    self.laps.clear()
    self._t = time.perf_counter()

  def lap(self, phase: str) -> None:
    now = time.perf_counter()
    self.laps.setdefault(phase, []).append(now - self._t)
    self._t = now

  def text(self) -> str:
    """"other 5.6 ms, data 3.7 ms, dispatch 31.4 ms (median 12.0), ...": the mean per step of
    each phase, and the median of the phase's laps where it differs from the mean by more
    than 20% (a few long laps, such as steps beside a background compile, or a steady cost)."""
    n = max(self.steps, 1)
    parts = []
    for k, laps in self.laps.items():
      mean, med = 1e3 * sum(laps) / n, 1e3 * float(np.median(laps))
      parts.append(f"{k} {mean:.1f} ms" + (f" (median {med:.1f})"
                                            if abs(med - mean) > 0.2 * max(mean, 1e-3) else ""))
    return ", ".join(parts)


def _flops_per_token(model_cfg, seq_len: int, params=None) -> float | None:
  try:
    return float(flops_per_token(model_cfg, seq_len, params)["total"])
  except Exception:  # pylint: disable=broad-except  (feedback only)
    return None


def _put(batch: dict[str, np.ndarray], shardings: dict[str, NamedSharding],
         global_rows: int | None = None) -> dict:
  """Global arrays from this process's rows (all of T): `global_rows` rows in all (default:
  the batch is the whole global batch, the same on every process; see
  `sharding.process_rows`)."""
  out = {}
  for k, v in batch.items():
    if k in shardings:
      v = np.asarray(v)
      shape = (global_rows or v.shape[0],) + v.shape[1:]
      out[k] = jax.make_array_from_process_local_data(shardings[k], v, shape)
  return out


def _evaluate(eval_step, state, batches, shardings) -> float | None:
  """Mean held-out loss (nats per token) over `batches` (None without batches)."""
  if not batches:
    return None
  loss_sum, tokens = 0.0, 0.0
  for b in batches:
    m = jax.device_get(eval_step(state, _put(b, shardings)))
    loss_sum += float(m["loss_sum"])
    tokens += float(m["tokens"])
  return loss_sum / max(tokens, 1.0)


def run(stage: StageConfig, workdir: str | pathlib.Path, *, progress: bool = True,
        progress_every: int = 50, alerts: metrics_lib.Alerts = metrics_lib.Alerts(),
        allow_config_change: bool = False, on_step: Callable[[int, dict], None] | None = None,
        devices: list[jax.Device] | None = None, precompile: bool | None = None
        ) -> RunResult:
  """Train `stage` in `<workdir>/<stage.name>/`; returns what happened (see RunResult).

  `progress`: a progress bar when stdout is a terminal; otherwise, or with progress=False, a
  plain line every `progress_every` steps (loss, tokens/s, MFU, drop rate, max/mean expert
  load, dead experts, ETA). `alerts`: routing thresholds past which it warns (once per eval
  interval). `allow_config_change`: resume although the saved stage config differs in a
  field that changes the optimisation (the differences are printed either way).
  `on_step(step, scalars)` is called after each step's metrics are read (tests and the
  ablations use it; it also gets the per-layer expert loads "moe/load" [layers, E]).
  `devices`: the devices of the mesh (default all). `precompile`: compile the train step, the
  2x-length eval step and (on one device) the sampler on host threads while the device works
  (`sparse_lm.train.precompile`; default None: on a GPU, not on a CPU host, whose cores the
  compiles would take from the steps).

  Raises:
    ValueError: an invalid stage config, a layout that does not divide the model, or a URL
      workdir (`workdir.local_workdir`).
    FileNotFoundError: `init_from` names a stage with no checkpoint in the workdir.
    TokenizerMismatchError: the checkpoint was written with another tokenizer.
    ConfigMismatchError: the checkpoint holds another model, or the stage config changed in a
      way that changes the optimisation (and not `allow_config_change`).
    WorkdirLockedError: another process is running this stage in this workdir.
    NonFiniteLossError: the loss became NaN/Inf (the last good checkpoint is kept).
  """
  stage.validate()
  workdir = local_workdir(workdir)
  stage_dir = workdir / stage.name
  model_cfg = stage.model_config()
  say = print if jax.process_index() == 0 else (lambda *a, **k: None)

  mesh = shd.make_mesh(stage.mesh, devices)
  shd.validate_layout(model_cfg, stage.mesh, mesh, global_batch=stage.global_batch,
                      seq_len=stage.seq_len, num_microbatches=stage.micro_batches)
  scaled = (f" (the full-scale stage uses {stage.reference_seq_len:,})"
            if stage.reference_seq_len and stage.reference_seq_len != stage.seq_len else "")
  say(f"[{stage.name}] preset {stage.preset}: seq_len {stage.seq_len:,} tokens{scaled}; "
      f"{stage.global_batch} sequences x {stage.seq_len:,} = {stage.tokens_per_batch:,} "
      f"tokens/step; {stage.steps} steps; mesh {dict(mesh.shape)}; workdir {stage_dir}")

  with WorkdirLock(stage_dir, primary=jax.process_index() == 0):
    tokenizer = data_lib.load_or_train_tokenizer(
        hf_import.data_config(stage.data, stage.init_from), str(workdir), model_cfg.vocab_size)
    say(f"[{stage.name}] {data_lib.describe(stage.data)}; tokenizer {tokenizer.fingerprint} "
        f"({tokenizer.vocab_size} ids)")
    parts = build(stage, mesh)
    with shd.use_mesh(mesh, stage.mesh.rules):
      ckpt = Checkpointer(stage_dir / "checkpoints", keep=stage.keep_checkpoints)
      init_record: dict = {}  # the init_from step this run starts from, if it does
      state, data_state = _starting_state(stage, workdir, mesh, parts, ckpt, tokenizer,
                                          allow_config_change, say, init_record=init_record)
      loop = _StageLoop(stage, mesh, parts, ckpt, tokenizer, data_state,
                        int(jax.device_get(state.step)), progress=progress,
                        progress_every=progress_every, alerts=alerts, on_step=on_step,
                        precompile=(jax.default_backend() == "gpu" if precompile is None
                                    else precompile),
                        allow_config_change=allow_config_change)
      if init_record:  # saved with every checkpoint: a resume can tell what it started from
        loop.meta[INIT_RECORD] = init_record
      no_eval = "no held-out split"
      if stage.data.eval_fraction > 0 and not loop.eval_batches:
        no_eval = "no held-out loss: the held-out split has no tokens"
        say(f"[{stage.name}] warning: the held-out split of {stage.data.source} has no tokens "
            f"(data.eval_fraction={stage.data.eval_fraction} of it is empty); no held-out "
            "loss will be reported: give more text or raise data.eval_fraction")
      try:
        start = int(jax.device_get(state.step))
        state, preempted = loop.train(state, start)
        end = int(jax.device_get(state.step))
        final_eval, sample = {}, ""
        if not preempted:
          loop.save(state, final=True)
          try:
            with InterruptWork():
              final_eval, sample = loop.finish(state, end)
          except Interrupted as e:  # the final checkpoint is saved; a rerun redoes the rest
            preempted = True
            say(f"[{stage.name}] {e.signal_name} during the end-of-stage held-out losses and "
                f"sample: stopped; the final checkpoint (step {end}) is saved to "
                f"{loop.ckpt.directory}; run the same command again to redo them.")
      finally:
        loop.close()
  if not preempted:
    say(f"[{stage.name}] done at step {end}: " + (", ".join(
        f"{k} {v:.4f}" for k, v in final_eval.items()) or no_eval) + loop.summary())
    if stage.sample_tokens > 0:
      say(f"[{stage.name}] sample: {stage.sample_prompt!r} -> {sample!r}")
  return RunResult(stage.name, start, end, loop.losses, loop.evals, final_eval, sample,
                   preempted, stage_dir)


def _starting_state(stage, workdir, mesh, parts, ckpt, tokenizer, allow_config_change, say,
                    *, init_record: dict | None = None) -> tuple[TrainState, dict | None]:
  """(state, data position) of this stage's latest checkpoint, else `init_from`, else fresh.
  `init_record` (if given) receives the `init_from` stage and step the stage started from
  (`INIT_RECORD`), from `_init_from` or, resuming, from the checkpoint's meta."""
  target = shd.with_shardings(parts.abstract_state, parts.state_shardings)
  changes: list[str] = []

  def check(meta):
    check_tokenizer(meta, tokenizer.fingerprint, f"checkpoint {ckpt.directory}",
                    stage.data.source)
    changes[:] = check_resume(meta, stage, allow_config_change=allow_config_change)

  restored = ckpt.restore_latest(lambda meta: _restore_target(meta, stage, mesh, target),
                                 check_meta=check)
  if restored is not None:
    state, data_state, meta = restored
    step = int(jax.device_get(state.step))
    say(f"[{stage.name}] resuming from step {step} ({ckpt.directory})")
    if meta.get(INIT_RECORD):
      if init_record is not None:
        init_record.update(meta[INIT_RECORD])
      warning = init_from_moved_on(stage.name, workdir, meta[INIT_RECORD], ckpt.directory)
      if warning:
        say(warning)
    if changes:
      say(f"[{stage.name}] config changed since the checkpoint: " + "; ".join(changes))
    if not _same_tree(state.opt_state, target.opt_state):
      # Only with --allow-config-change (check_resume refuses an optim.* change otherwise).
      say(f"[{stage.name}] the checkpoint's optimizer state ({_optim_name(meta)}) does not "
          f"fit optim.name={stage.optim.name!r}: the optimizer state starts fresh, the "
          f"learning-rate schedule goes on from step {step}")
      state = state.replace(opt_state=_fresh_opt_state(parts, state.params, step))
    return state, data_state
  if stage.init_from:
    return _init_from(stage, workdir, mesh, target, tokenizer.fingerprint, parts, say,
                      record=init_record), None
  return parts.init(), None


def _optim_name(meta) -> str:
  return f"optim.name={((meta.get('stage') or {}).get('optim') or {}).get('name')!r}"


def _same_tree(a, b) -> bool:
  """Whether two (abstract or concrete) trees have one structure and the same leaf shapes."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(x.shape == y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _restore_target(meta, stage, mesh, target):
  """What to restore a checkpoint into: `target` (this run's state), but with the optimizer
  state of the optimizer the checkpoint was saved with when that one's tree differs (a run
  resumed with --allow-config-change, or a stage initialised from another, under another
  `optim.name`): its arrays are read as they were saved instead of failing as unreadable."""
  saved = (meta.get("stage") or {}).get("optim")
  if saved is None or saved == to_json(stage.optim):
    return target
  # The saved stage's optimizer on this run's model and mesh (the layout may have changed);
  # its state's form first (cheap: no model trace), the whole build only when it differs.
  saved_stage = dataclasses.replace(stage_from_json(meta["stage"]), mesh=stage.mesh,
                                    model_overrides=stage.model_overrides, preset=stage.preset)
  tx = make_optimizer(saved_stage.optim, saved_stage.steps)
  if _same_tree(jax.eval_shape(tx.init, target.params), target.opt_state):
    return target
  other = build(saved_stage, mesh)
  opt = shd.with_shardings(other.abstract_state.opt_state, other.state_shardings.opt_state)
  return target if _same_tree(opt, target.opt_state) else target.replace(opt_state=opt)


def _fresh_opt_state(parts, params, step: int):
  """This run's optimizer initialised on `params`, its schedule counter at `step`."""
  sh = parts.state_shardings.opt_state
  return jax.jit(lambda p: set_schedule_count(parts.tx.init(p), step), out_shardings=sh)(params)


class _StageLoop:
  """The step loop of one run: data, checkpoints, evaluation and feedback."""

  def __init__(self, stage, mesh, parts, ckpt, tokenizer, data_state, start_step: int, *,
               progress, progress_every, alerts, on_step, precompile=False,
               allow_config_change=False):
    self.stage, self.mesh, self.parts, self.ckpt, self.tokenizer = (stage, mesh, parts, ckpt,
                                                                    tokenizer)
    self.alerts, self.on_step = alerts, on_step
    stage_dir = ckpt.directory.parent
    self.meta = make_meta(stage, tokenizer.fingerprint, tokenizer.to_json())
    self.batch_sh = parts.batch_shardings
    # This host loads its row group, all T (hosts that split the same rows over T load the
    # same rows); one process loads everything.
    self.shard, num_shards = shd.process_rows(self.batch_sh["tokens"],
                                              (stage.global_batch, stage.seq_len))
    self.train_iter = data_lib.make_train_iterator(
        stage.data, tokenizer, seq_len=stage.seq_len,
        batch_size=stage.global_batch // num_shards, process_index=self.shard,
        process_count=num_shards, patch_size=stage.model_config().vision_patch_size)
    mine = shard_state(data_state, self.shard)
    if mine:
      try:
        self.train_iter.set_state(mine)
      except data_lib.PipelineChangedError as e:
        if not allow_config_change:
          raise
        # The batch, length or data changed on purpose: the saved position means nothing in
        # the new stream, which starts from its beginning.
        if jax.process_index() == 0:  # as `say`: one line per run, not per host
          print(f"[{stage.name}] --allow-config-change: the data stream starts over ({e})",
                flush=True)
    self.eval_rows = stage.eval_batch_size or stage.global_batch
    self.eval_batches = self._eval_batches(stage.seq_len)
    # a resumed run logs from start_step on: lines a killed run wrote past it are dropped
    self.writer = metrics_lib.MetricsWriter(stage_dir / "tb", after_step=start_step)
    model_cfg = stage.model_config()
    self.flops = _flops_per_token(model_cfg, stage.seq_len, parts.abstract_state.params)
    self.can_drop = (model_cfg.ragged_buffer_factor is not None
                     or model_cfg.capacity_factor is not None)
    self.peak = metrics_lib.peak_flops_per_device()
    self.bar = None
    self.progress, self.progress_every = progress, progress_every
    self.speed = metrics_lib.Throughput()
    self.losses: dict[int, float] = {}
    self.evals: dict[int, float] = {}
    self.drop_rates: list[tuple[int, float]] = []
    self.warned: dict[str, int] = {}
    self.last_saved = ckpt.all_steps()[-1] if ckpt.all_steps() else None
    self.pending: tuple[int, Any] | None = None
    self.clock = _HostClock()
    self.pre = Precompiler(precompile, label=f"[{stage.name}] ")

  def _eval_batches(self, seq_len):
    if self.stage.data.eval_fraction <= 0:
      return []
    return data_lib.make_eval_batches(self.stage.data, self.tokenizer, seq_len=seq_len,
                                      batch_size=self.eval_rows,
                                      num_batches=self.stage.eval_batches,
                                      patch_size=self.stage.model_config().vision_patch_size)

  def train(self, state, start) -> tuple[TrainState, bool]:
    """Steps `start`..`stage.steps`; (state, whether a signal stopped it early)."""
    stage = self.stage
    self.bar = metrics_lib.Progress(stage.steps, start, stage.name, enabled=self.progress,
                                    every=self.progress_every)
    with Preemption() as preemption, contextlib.ExitStack() as stack:
      # From here on a signal is held for the step loop: one that comes during the compiles
      # and the step-0 eval (C++ work: Python's handler runs when it returns) stops the run
      # before its first step, instead of a KeyboardInterrupt traceback or a silent SIGTERM.
      self._precompile(state)
      if start == 0:
        self.pre.wait("eval")  # the main thread traces nothing while the jobs do
        self.evaluate(state, 0)
      self.pre.wait("sample")  # reads `state`: done before the first step donates it
      self.pre.wait("train")
      if preemption.requested:
        kept = (f"the last checkpoint is step {self.last_saved} in {self.ckpt.directory}"
                if self.last_saved is not None else "no checkpoint of this stage was saved")
        self.bar.print(f"[{stage.name}] {preemption.requested} before step {start} (during "
                       f"the compiles{' and the step-0 eval' if start == 0 else ''}): stopped "
                       f"with nothing new to save; {kept}; run the same command again to "
                       + ("resume from it." if self.last_saved is not None else
                          "start the stage."))
        return state, True
      clock = self.clock = _HostClock()
      step_gc = _StepGC(stage.gc_every)
      fetch = BatchFetcher(self.train_iter)
      stack.callback(fetch.close)
      for step in range(start, stage.steps):
        clock.lap("other")
        t0 = time.perf_counter()
        rows = fetch.next(lambda: preemption.requested is not None)
        if rows is None:  # stopped while the data pipeline stalled
          self._stop_waiting_for_data(state, step, start, preemption.requested, fetch)
          return state, True
        batch = _put(rows, self.batch_sh, stage.global_batch)
        clock.lap("data")
        state, m = self.parts.train_step(state, batch)
        clock.lap("dispatch")
        if step == start:
          jax.block_until_ready(m)
          self.bar.print(f"[{stage.name}] first step (trace + compile + run) took "
                         f"{time.perf_counter() - t0:.1f} s")
          stack.enter_context(step_gc)
          clock.restart()
        else:
          step_gc.step(step + 1)
          clock.lap("gc")
        self.drain(state)
        clock.steps += step > start
        self.pending = (step, m)
        done = step + 1
        periodic = done % stage.checkpoint_every == 0
        evaluating = done % stage.eval_every == 0
        stop = preemption.stop_after(done)
        if periodic or evaluating or stop:
          self.drain(state)
        if periodic and done < stage.steps:
          self.save(state)
        if evaluating and done < stage.steps:
          self.evaluate(state, done)
        if stop and done < stage.steps:
          if not periodic:
            self.save(state)
          self.ckpt.wait()
          self.bar.print(f"[{stage.name}] {stop}: saved step {done} to "
                         f"{self.ckpt.directory}; run the same command again to resume.")
          return state, True
      self.drain(state)
    if clock.steps >= 10:
      self.bar.print(f"[{stage.name}] host time per step after the first: {clock.text()}")
    return state, False

  def _precompile(self, state):
    """Start compiling the train step, the 2x eval step and the sampler (see `precompile`)."""
    stage, parts = self.stage, self.parts

    def sample():  # from the starting weights: compiles the final sample's programs
      with shd.use_mesh(self.mesh):
        _sample(parts.graphdef, state, self.tokenizer, stage)
    # Run beside the step-0 eval on one device only (on a mesh it compiles at the end).
    self.pre.start(stage, parts, self.batch_sh, self.eval_rows if self.eval_batches else 0,
                   sample if stage.sample_tokens > 0 and self.mesh.size == 1 else None)

  def save(self, state, final=False, iter_state=None):
    """Save `state` with the data iterator's position (`iter_state`: one read before, for a
    save while the iterator cannot be read)."""
    if iter_state is None:
      iter_state = self.train_iter.get_state()
    data_state = data_item(data_lib.state_to_json_compatible(iter_state), self.shard)
    self.last_saved = self.ckpt.save(state, data_state=data_state, meta=self.meta, final=final)

  def _stop_waiting_for_data(self, state, step, start, signame, fetch) -> None:
    """A stop request (`signame`) came while the loop waited for the batch of `step`: save
    `state` (after `step` steps) with the data position from before that batch, as a stop at
    a step boundary does, and say so. Not saved: a stop before this run's first step (nothing
    new), and a stop on several processes (the save's collectives need every process, and
    the others wait in the step for this one's batch); the last checkpoint stays."""
    stage = self.stage
    self.drain(state)  # the previous step's metrics (may raise NonFiniteLossError)
    why = (f"[{stage.name}] {signame} while waiting {fetch.waited:.1f} s for the batch of "
           f"step {step} (the data pipeline is stalled or slow)")
    if step > start and jax.process_count() == 1:
      self.save(state, iter_state=fetch.state_before)
      self.ckpt.wait()
      self.bar.print(f"{why}: saved step {step} to {self.ckpt.directory} with the data "
                     "position before that batch; run the same command again to resume.")
      return
    kept = (f"the last checkpoint is step {self.last_saved} in {self.ckpt.directory}"
            if self.last_saved is not None else "no checkpoint of this stage was saved")
    reason = ("no step was trained since the start" if step == start else
              "a save needs every process, and the others wait for this one's batch")
    self.bar.print(f"{why}: stopped without saving ({reason}); {kept}; run the same command "
                   "again to " + ("resume from it." if self.last_saved is not None else
                                  "start the stage."))

  def drain(self, state):
    """Read the metrics of the last dispatched step; stop on a non-finite loss."""
    if self.pending is None:
      return
    step, m = self.pending
    self.pending = None
    clock = self.clock
    m = jax.device_get(m)
    clock.lap("wait")
    scalars = {k: float(np.asarray(v).reshape(())) for k, v in m.items() if np.size(v) == 1}
    if not scalars["finite"] or not np.isfinite(scalars["loss"]):
      self.ckpt.wait()
      kept = (f"the last good checkpoint is step {self.last_saved} in {self.ckpt.directory}"
              if self.last_saved is not None else "no checkpoint had been saved yet")
      raise NonFiniteLossError(
          f"[{self.stage.name}] non-finite loss ({scalars['loss']}) or gradient norm "
          f"({scalars['grad_norm']}) at step {step} (0-based, the {step + 1}-th batch of "
          f"this stage); training stopped and the update was not applied; {kept}.")
    self.losses[step] = scalars["loss"]
    self.speed.tick()
    tps = self.speed.rate(self.stage.tokens_per_batch)
    mfu = metrics_lib.mfu(tps, self.flops or 0.0, jax.device_count(), self.peak)
    routing = metrics_lib.routing_summary(m)
    if not self.can_drop and not routing.get("moe/drop_rate_total"):
      # dropless: every drop rate is 0 by construction; not shown
      routing = {k: v for k, v in routing.items() if not k.startswith("moe/drop_rate")}
    if "moe/drop_rate_total" in routing:
      self.drop_rates.append((step + 1, routing["moe/drop_rate_total"]))
    timed = {"tokens_per_s": tps, **({"mfu": mfu} if mfu else {})} if tps > 0 else {}
    self.writer.write(step, {**m, **routing, **timed}, prefix="train/")  # none untimed
    self.bar.update(step + 1, scalars["loss"], tps, mfu, routing)
    interval = (step + 1) // self.stage.eval_every
    for kind, message in metrics_lib.routing_warnings(routing, self.alerts):
      if self.warned.get(kind) != interval:
        self.warned[kind] = interval
        self.bar.print(f"[{self.stage.name}] warning at step {step + 1}: {message}")
    if self.on_step is not None:
      self.on_step(step, {**scalars, **{k: v for k, v in routing.items()
                                        if isinstance(v, float)},
                          **({"moe/load": np.asarray(m["moe/load"])} if "moe/load" in m else {})})
    clock.lap("log")

  def evaluate(self, state, step):
    loss = _evaluate(self.parts.eval_step, state, self.eval_batches, self.batch_sh)
    if loss is None:
      return
    self.evals[step] = loss
    self.writer.write(step, {"loss": loss}, prefix="eval/")
    self.bar.print(f"[{self.stage.name}] step {step}: held-out loss {loss:.4f}")

  def finish(self, state, end) -> tuple[dict[str, float], str]:
    """Held-out losses at 1x and 2x the length, and the sample (after the final save)."""
    stage = self.stage
    final_eval, sample = {}, ""
    self.evaluate(state, end)
    if end in self.evals:
      final_eval[f"eval_loss@{stage.seq_len}"] = self.evals[end]
      self.pre.wait("eval_2x")
      final_eval[f"eval_loss@{2 * stage.seq_len}"] = _evaluate(
          self.parts.eval_step, state, self._eval_batches(2 * stage.seq_len), self.batch_sh)
      self.writer.write(end, {k.replace("@", "_at_"): v for k, v in final_eval.items()},
                        prefix="final/")
    if stage.sample_tokens > 0:
      # The engine on the stage's mesh (weights as trained), the default (batch) rules: a short
      # prompt is not split over expert x context (as MaxText, expert_shards: training only).
      with shd.use_mesh(self.mesh):
        sample = _sample(self.parts.graphdef, state, self.tokenizer, stage)
      self.writer.text("sample", sample, end)
    return final_eval, sample

  def summary(self) -> str:
    """The stage's expert-parallel drop rate, for the end-of-run line ("" without drops)."""
    if not self.drop_rates:
      return ""
    rates = [r for _, r in self.drop_rates]
    worst_step, worst = max(self.drop_rates, key=lambda x: x[1])
    return (f"; expert-parallel drop rate {100 * float(np.mean(rates)):.2f}% mean over "
            f"{len(rates)} steps, {100 * worst:.2f}% max (step {worst_step})")

  def close(self):
    self.pre.close()
    if self.bar is not None:
      self.bar.close()
    self.ckpt.close()
    self.writer.close()


# The meta key of the `init_from` checkpoint a stage started from: {"stage", "step", "final"}.
INIT_RECORD = "init_from_checkpoint"


def init_from_moved_on(name: str, workdir, record: dict, ckpt_dir) -> str | None:
  """A warning when stage `name` (resumed from its own checkpoints in `ckpt_dir`) started from
  an unfinished checkpoint of its `init_from` stage (`record`, `INIT_RECORD`) and that stage
  has a newer step now: the resumed stage goes on from the older weights. None otherwise."""
  if not record or record.get("final") or not isinstance(record.get("step"), int):
    return None
  prev_dir = pathlib.Path(workdir) / str(record.get("stage")) / "checkpoints"
  steps = (sorted(int(p.name) for p in prev_dir.iterdir() if p.name.isdigit())
           if prev_dir.is_dir() else [])
  if not steps or steps[-1] <= record["step"]:
    return None
  return (f"[{name}] warning: {name} started from {record['stage']} step {record['step']}, "
          f"before {record['stage']} finished; {record['stage']} has step {steps[-1]} now, "
          f"which this run does not use (it resumes {name}'s own checkpoints). To start {name} "
          f"again from it, move {ckpt_dir} aside and run the same command.")


def _init_from_missing(stage, workdir, prev_dir) -> str:
  """What to do when `stage.init_from` names neither a stage with a checkpoint nor an import."""
  where = f"[{stage.name}] init_from={stage.init_from!r}"
  scratch = "or --set init_from=None to start from scratch"
  if "/" not in stage.init_from and not stage.init_from.startswith("."):  # a stage's name
    return (f"{where}: no checkpoint in {prev_dir}; run `python -m experiments."
            f"{stage.init_from} --preset={stage.preset} --workdir={workdir}` first, {scratch}")
  path = pathlib.Path(stage.init_from)
  if (path / "config.json").is_file():  # an HF checkpoint directory, not yet imported
    return (f"{where} is an HF checkpoint directory, not an import: run `python -m "
            f"sparse_lm.interop.hf import --hf_dir {path} --workdir W` and pass "
            f"--set init_from=W, {scratch}")
  return (f"{where}: neither an HF import (no {path}/hf_import/sparse_lm_model.json; `python "
          f"-m sparse_lm.interop.hf import --hf_dir D --workdir W` writes one, then pass W) nor "
          f"a stage directory with checkpoints ({prev_dir}); to continue a stage of this "
          f"workdir pass its name (stage_8k, ...), {scratch}")


def _init_from(stage, workdir, mesh, target, fingerprint, parts, say, record=None
               ) -> TrainState:
  """The previous stage's final checkpoint, restarted at step 0 of this stage (or, when
  init_from is an HF import directory, its weights with a fresh optimizer)."""
  tx, state_sh = parts.tx, parts.state_shardings
  if hf_import.imported_config(stage.init_from) is not None:
    params, model_vars = hf_import.restore_variables(stage.init_from, target.params,
                                                     target.model_vars)
    say(f"[{stage.name}] initialised from the HF import in {stage.init_from} (fresh optimizer; "
        "data tokenizer: " + (stage.data.tokenizer or hf_import.tokenizer_path(stage.init_from)
                              or "the stage's own") + ")")
    opt_state = jax.jit(tx.init, out_shardings=state_sh.opt_state)(params)
    return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), state_sh.step),
                      params=params, model_vars=model_vars, opt_state=opt_state,
                      rng=jax.device_put(jax.random.PRNGKey(stage.seed + 1), state_sh.rng))
  prev_dir = workdir / stage.init_from / "checkpoints"
  if not prev_dir.is_dir():  # before the Checkpointer, which would create it (empty)
    raise FileNotFoundError(_init_from_missing(stage, workdir, prev_dir))
  prev = Checkpointer(prev_dir, keep=10**6)
  def check(meta):
    check_model(meta, stage.model_config(), stage.name)
    if (stage.keep_optimizer_state
        and _restore_target(meta, stage, mesh, target) is not target):
      raise ConfigMismatchError(
          f"[{stage.name}] init_from={stage.init_from!r}: its step {meta.get('step')} was "
          f"trained with {_optim_name(meta)} and this stage uses "
          f"optim.name={stage.optim.name!r}, whose state has another form: the optimizer state "
          "cannot be kept. Pass --set keep_optimizer_state=false to start this optimizer "
          f"fresh from {stage.init_from}'s weights, or use the same optimizer.")

  restored = (prev.restore_latest(lambda meta: _restore_target(meta, stage, mesh, target),
                                  check_meta=check) if prev_dir.exists() else None)
  if restored is None:
    raise FileNotFoundError(_init_from_missing(stage, workdir, prev_dir))
  state, _, meta = restored
  prev.close()
  check_tokenizer(meta, fingerprint, f"stage {stage.init_from} checkpoint {prev_dir}",
                  stage.data.source)
  if not meta.get("final"):
    say(f"[{stage.name}] warning: {stage.init_from} did not finish; using its step "
        f"{meta.get('step')} checkpoint")
  if record is not None:
    record.update(stage=stage.init_from, step=meta.get("step"), final=bool(meta.get("final")))
  say(f"[{stage.name}] initialised from {stage.init_from} step {meta.get('step')} ({prev_dir})"
      f"{', optimizer state kept' if stage.keep_optimizer_state else ''}")
  if stage.keep_optimizer_state:
    opt_state = jax.jit(reset_schedule_count, out_shardings=state_sh.opt_state)(state.opt_state)
  else:
    opt_state = jax.jit(tx.init, out_shardings=state_sh.opt_state)(state.params)
  step = jax.device_put(jnp.zeros((), jnp.int32), state_sh.step)
  return state.replace(step=step, opt_state=opt_state)


def _sample(graphdef, state, tokenizer, stage) -> str:
  """Greedy continuation of `stage.sample_prompt` after <bos>, as training documents begin and
  as `python -m sparse_lm.generate` prompts (so both print the same text for one checkpoint)."""
  prompt = [tokenizer.bos_id] + tokenizer.encode(stage.sample_prompt)
  ids = generate(graphdef, state.params, state.model_vars, prompt,
                 max_new_tokens=stage.sample_tokens, temperature=0.0,
                 pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
  return tokenizer.decode(ids, skip_special=True)
