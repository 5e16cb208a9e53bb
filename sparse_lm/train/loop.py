"""`run(stage, workdir)`: train one stage of the curriculum, with feedback and checkpoints.

The shape of the Flax Gemma example's loop: the mesh is made once, the state is built (or
restored) under it with explicit shardings, one jitted step with donated state runs per batch,
a checkpoint manager saves every `checkpoint_every` steps, at the end and on SIGTERM, and a
metrics writer and a progress bar report as it goes.

Starting point of a stage, in order: its own latest checkpoint in `<workdir>/<stage>/`
(resume: model, optimizer, step, RNG and data position); else the final checkpoint of
`stage.init_from` in the same workdir (weights, balancer biases and by default the optimizer
moments; step, schedule and data restart); else a fresh initialisation.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sparse_lm import sharding as shd
from sparse_lm.moe import expert_parallel
from sparse_lm.train import metrics as metrics_lib
from sparse_lm.train.checkpoint import Checkpointer, check_tokenizer, reset_schedule_count
from sparse_lm.train.config import StageConfig
from sparse_lm.train.optimizer import make_optimizer, wsd_schedule
from sparse_lm.train.sample import generate
from sparse_lm.train.state import TrainState, graphdef_of, make_init_fn
from sparse_lm.train.step import make_eval_step, make_train_step


BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
# With `data.images`: packed encoder patches [B, L, p*p*3], their segment ids [B, L] and
# patch coordinates [B, L, 2] (sparse_lm/data/images.py), sharded like the rows.
IMAGE_BATCH_KEYS = {"image_patches": 3, "image_segment_ids": 2, "image_coords": 3}


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


class _Preemption:
  """SIGTERM handler: ask the loop to save and stop after the current step."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _model_factory(stage: StageConfig) -> Callable[[int], nnx.Module]:
  from sparse_lm.model.transformer import Transformer
  model_cfg = stage.model_config()
  return lambda seed: Transformer(model_cfg, rngs=nnx.Rngs(seed))


def _balance_fn(model: nnx.Module) -> dict[str, jax.Array]:
  """The §6 bias update of every MoE layer (after the optimizer step)."""
  from sparse_lm.moe.balancing import update_balancers
  return update_balancers(model)


def _flops_per_token(model_cfg, seq_len: int) -> float | None:
  try:
    from sparse_lm.model.params import flops_per_token
    return float(flops_per_token(model_cfg, seq_len)["total"])
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


def _all_shard_states(state: dict, shard: int) -> dict:
  """{"shards": {row group: its data-iterator state}} from every process (the checkpoint's
  JSON item is written by the primary process only, so it must hold every row group's
  position; processes of one row group hold equal states)."""
  if jax.process_count() == 1:
    return {"shards": {str(shard): state}}
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  blob = np.frombuffer(json.dumps(state).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([blob.size], np.int32)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:blob.size] = blob
  blobs = np.asarray(multihost_utils.process_allgather(padded))
  shards = np.asarray(multihost_utils.process_allgather(np.array([shard], np.int32)))
  return {"shards": {str(int(shards[i].reshape(-1)[0])): json.loads(
      bytes(blobs[i][:int(sizes[i].reshape(-1)[0])]).decode()) for i in range(len(blobs))}}


def _shard_state(data_state: dict | None, shard: int) -> dict | None:
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


def _evaluate(eval_step, state, batches, shardings) -> float:
  loss_sum, tokens = 0.0, 0.0
  for b in batches:
    m = jax.device_get(eval_step(state, _put(b, shardings)))
    loss_sum += float(m["loss_sum"])
    tokens += float(m["tokens"])
  return loss_sum / max(tokens, 1.0)


@dataclasses.dataclass
class Parts:
  """What a stage compiles: shared by every run of an equal configuration in one process (a
  notebook re-running a stage, tests), so the second run neither re-traces nor re-compiles."""

  graphdef: nnx.GraphDef
  tx: Any
  init: Callable[[], TrainState]  # jitted, returns the sharded fresh state
  abstract_state: TrainState
  state_shardings: TrainState
  batch_shardings: dict[str, NamedSharding]  # per BATCH_KEYS entry, under the stage's rules
  train_step: Callable
  eval_step: Callable


_PARTS: dict[tuple, Parts] = {}


def _traced_in(stage: StageConfig, mesh: jax.sharding.Mesh, fn: Callable) -> Callable:
  """`fn` that is traced under the stage's mesh, logical-axis rules and expert-parallel
  options, whatever context the caller has active (they decide the shardings, the
  context-parallel axes and the expert exchange inside the step)."""
  def traced(*args):
    with shd.use_mesh(mesh, stage.mesh.rules), expert_parallel.options(
        impl=stage.ep_impl, recv_capacity_factor=stage.ep_capacity_factor):
      return fn(*args)
  return traced


def build(stage: StageConfig, mesh: jax.sharding.Mesh) -> Parts:
  """The model graph, optimizer, abstract state with shardings and the jitted steps."""
  key = (stage.model_config(), stage.optim, stage.steps, stage.micro_batches,
         stage.z_loss_coef, stage.nan_at_step, stage.seed, mesh, stage.mesh.rules,
         stage.ep_impl, stage.ep_capacity_factor)
  if key in _PARTS:
    return _PARTS[key]
  model_cfg = stage.model_config()
  tx = make_optimizer(stage.optim, stage.steps)
  schedule = wsd_schedule(stage.optim, stage.steps)
  factory = _model_factory(stage)
  init = make_init_fn(factory, tx, stage.seed)
  repl = NamedSharding(mesh, P())
  with shd.use_mesh(mesh, stage.mesh.rules):
    graphdef = graphdef_of(factory, stage.seed)
    abstract = jax.eval_shape(init)
    state_sh = shd.state_shardings(abstract, mesh)
    batch_sh = {k: shd.batch_sharding(mesh) for k in BATCH_KEYS}
    if stage.data.images:
      batch_sh.update({k: shd.batch_sharding(mesh, nd) for k, nd in IMAGE_BATCH_KEYS.items()})
  balance = _balance_fn if model_cfg.balancer != "none" else None
  train_step = jax.jit(
      _traced_in(stage, mesh, make_train_step(
          graphdef, tx, schedule, _loss_fn(), micro_batches=stage.micro_batches,
          z_loss_coef=stage.z_loss_coef, balance_fn=balance, nan_at_step=stage.nan_at_step)),
      in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl), donate_argnums=0)
  eval_fn = _traced_in(stage, mesh, make_eval_step(graphdef, _loss_fn()))
  eval_step = jax.jit(eval_fn, in_shardings=(state_sh, batch_sh), out_shardings=repl)
  if mesh.size == 1:
    # One device: initialise op by op (compiling the init program of a small model takes
    # longer than running it); on a real mesh the jitted init places every shard directly.
    init_fn = lambda: jax.device_put(init(), state_sh)
  else:
    init_fn = jax.jit(init, out_shardings=state_sh)
  parts = Parts(graphdef, tx, init_fn, abstract, state_sh, batch_sh, train_step, eval_step)
  _PARTS[key] = parts
  return parts


def run(stage: StageConfig, workdir: str | pathlib.Path, *, progress: bool = True,
        on_step: Callable[[int, dict], None] | None = None,
        devices: list[jax.Device] | None = None) -> RunResult:
  """Train `stage` in `<workdir>/<stage.name>/`; returns what happened (see RunResult).

  `on_step(step, scalars)` is called after each step's metrics are read (tests use it).
  `devices`: the devices of the mesh (default all).

  Raises:
    ValueError: an invalid stage config or a layout that does not divide the model.
    FileNotFoundError: `init_from` names a stage with no checkpoint in the workdir.
    TokenizerMismatchError: the checkpoint was written with another tokenizer.
    NonFiniteLossError: the loss became NaN/Inf (the last good checkpoint is kept).
  """
  from sparse_lm import data as data_lib

  stage.validate()
  workdir = pathlib.Path(workdir).absolute()
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

  workdir.mkdir(parents=True, exist_ok=True)
  tokenizer = data_lib.load_or_train_tokenizer(stage.data, str(workdir), model_cfg.vocab_size)
  say(f"[{stage.name}] {data_lib.describe(stage.data)}; tokenizer {tokenizer.fingerprint} "
      f"({tokenizer.vocab_size} ids)")
  tok_meta = {"fingerprint": tokenizer.fingerprint, "json": tokenizer.to_json()}
  meta = {"stage": _jsonable(dataclasses.asdict(stage)), "tokenizer": tok_meta}

  parts = build(stage, mesh)
  graphdef, tx, state_sh = parts.graphdef, parts.tx, parts.state_shardings
  repl = NamedSharding(mesh, P())

  with shd.use_mesh(mesh, stage.mesh.rules):
    target = shd.with_shardings(parts.abstract_state, state_sh)
    ckpt = Checkpointer(stage_dir / "checkpoints", keep=stage.keep_checkpoints)
    restored = ckpt.restore_latest(target)
    data_state = None
    if restored is not None:
      state, data_state, saved_meta = restored
      check_tokenizer(saved_meta, tokenizer.fingerprint, f"checkpoint {ckpt.directory}")
      say(f"[{stage.name}] resuming from step {int(state.step)} ({ckpt.directory})")
    elif stage.init_from:
      state = _init_from(stage, workdir, target, tokenizer.fingerprint, tx, state_sh, say)
    else:
      state = parts.init()
    start = int(jax.device_get(state.step))

    batch_sh = parts.batch_shardings
    # This host loads its row group, all T (hosts that split the same rows over T load the
    # same rows); one process loads everything.
    shard, num_shards = shd.process_rows(batch_sh["tokens"], (stage.global_batch,
                                                              stage.seq_len))
    train_iter = data_lib.make_train_iterator(
        stage.data, tokenizer, seq_len=stage.seq_len,
        batch_size=stage.global_batch // num_shards, process_index=shard,
        process_count=num_shards, patch_size=model_cfg.vision_patch_size)
    mine = _shard_state(data_state, shard)
    if mine:
      train_iter.set_state(mine)
    eval_rows = stage.eval_batch_size or stage.global_batch
    eval_batches = data_lib.make_eval_batches(
        stage.data, tokenizer, seq_len=stage.seq_len, batch_size=eval_rows,
        num_batches=stage.eval_batches, patch_size=model_cfg.vision_patch_size)

    train_step, eval_step = parts.train_step, parts.eval_step
    writer = metrics_lib.MetricsWriter(stage_dir / "tb")
    flops = _flops_per_token(model_cfg, stage.seq_len)
    peak = metrics_lib.peak_flops_per_device()
    bar = metrics_lib.Progress(stage.steps, start, stage.name, enabled=progress)
    speed = metrics_lib.Throughput()
    losses: dict[int, float] = {}
    evals: dict[int, float] = {}
    last_saved = ckpt.all_steps()[-1] if ckpt.all_steps() else None
    pending: tuple[int, Any] | None = None

    def save(final=False):
      nonlocal last_saved
      data_state = _all_shard_states(
          data_lib.state_to_json_compatible(train_iter.get_state()), shard)
      last_saved = ckpt.save(state, data_state=data_state, meta=meta, final=final)

    def drain():
      """Read the metrics of the last dispatched step; stop on a non-finite loss."""
      nonlocal pending
      if pending is None:
        return
      step, m = pending
      pending = None
      m = jax.device_get(m)
      scalars = {k: float(np.asarray(v).reshape(())) for k, v in m.items() if np.size(v) == 1}
      if not scalars["finite"] or not np.isfinite(scalars["loss"]):
        ckpt.wait()
        bar.close()
        writer.close()
        kept = (f"the last good checkpoint is step {last_saved} in {ckpt.directory}"
                if last_saved is not None else "no checkpoint had been saved yet")
        raise NonFiniteLossError(
            f"[{stage.name}] non-finite loss ({scalars['loss']}) or gradient norm "
            f"({scalars['grad_norm']}) at step {step} (0-based, the {step + 1}-th batch of "
            f"this stage); training stopped and the update was not applied; {kept}.")
      losses[step] = scalars["loss"]
      speed.tick()
      tps = speed.rate(stage.tokens_per_batch)
      mfu = metrics_lib.mfu(tps, flops or 0.0, jax.device_count(), peak)
      writer.write(step, {**m, "tokens_per_s": tps, **({"mfu": mfu} if mfu else {})},
                   prefix="train/")
      bar.update(step + 1, scalars["loss"], tps, mfu, scalars.get("balancer/max_violation"))
      if on_step is not None:
        on_step(step, scalars)

    def evaluate(step):
      evals[step] = _evaluate(eval_step, state, eval_batches, batch_sh)
      writer.write(step, {"loss": evals[step]}, prefix="eval/")
      bar.print(f"[{stage.name}] step {step}: held-out loss {evals[step]:.4f}")

    first = None
    if start == 0:
      evaluate(0)
    preempted = False
    with _Preemption() as preemption:
      for step in range(start, stage.steps):
        t0 = time.perf_counter()
        state, m = train_step(state, _put(next(train_iter), batch_sh, stage.global_batch))
        if step == start:
          jax.block_until_ready(m)
          say(f"[{stage.name}] first step (trace + compile + run) took "
              f"{time.perf_counter() - t0:.1f} s")
        drain()
        pending = (step, m)
        done = step + 1
        if done % stage.checkpoint_every == 0 or done % stage.eval_every == 0 or \
            preemption.requested:
          drain()
        if done % stage.checkpoint_every == 0 and done < stage.steps:
          save()
        if done % stage.eval_every == 0 and done < stage.steps:
          evaluate(done)
        if preemption.requested and done < stage.steps:
          save()
          ckpt.wait()
          bar.print(f"[{stage.name}] SIGTERM: saved step {done} to {ckpt.directory}; "
                    "run the same command again to resume.")
          preempted = True
          break
      drain()

    end = int(jax.device_get(state.step))
    final_eval, sample = {}, ""
    if not preempted:
      save(final=True)
      evaluate(end)
      final_eval[f"eval_loss@{stage.seq_len}"] = evals[end]
      long_rows = eval_rows
      long_batches = data_lib.make_eval_batches(
          stage.data, tokenizer, seq_len=2 * stage.seq_len, batch_size=long_rows,
          num_batches=stage.eval_batches, patch_size=model_cfg.vision_patch_size)
      final_eval[f"eval_loss@{2 * stage.seq_len}"] = _evaluate(eval_step, state, long_batches,
                                                                batch_sh)
      writer.write(end, {k.replace("@", "_at_"): v for k, v in final_eval.items()},
                   prefix="final/")
      if stage.sample_tokens > 0:
        # Generation uses the default (batch) rules: a short prompt cannot be split over
        # expert x context (as in MaxText, expert_shards applies to training only).
        with shd.use_mesh(mesh):
          sample = _sample(graphdef, state, tokenizer, stage)
        writer.text("sample", sample, end)
    bar.close()
    ckpt.close()
    writer.close()
  if not preempted:
    say(f"[{stage.name}] done at step {end}: " + ", ".join(
        f"{k} {v:.4f}" for k, v in final_eval.items()))
    if stage.sample_tokens > 0:
      say(f"[{stage.name}] sample: {stage.sample_prompt!r} -> {sample!r}")
  return RunResult(stage.name, start, end, losses, evals, final_eval, sample, preempted,
                   stage_dir)


def _loss_fn():
  from sparse_lm.model.loss import loss_fn
  return loss_fn


def _init_from(stage, workdir, target, fingerprint, tx, state_sh, say) -> TrainState:
  """The previous stage's final checkpoint, restarted at step 0 of this stage."""
  prev_dir = workdir / stage.init_from / "checkpoints"
  prev = Checkpointer(prev_dir, keep=10**6)
  restored = prev.restore_latest(target) if prev_dir.exists() else None
  if restored is None:
    raise FileNotFoundError(
        f"[{stage.name}] init_from={stage.init_from!r}: no checkpoint in {prev_dir}; run "
        f"`python -m experiments.{stage.init_from} --preset={stage.preset} "
        f"--workdir={workdir}` first, or --set init_from=None to start from scratch")
  state, _, meta = restored
  prev.close()
  check_tokenizer(meta, fingerprint, f"stage {stage.init_from} checkpoint {prev_dir}")
  if not meta.get("final"):
    say(f"[{stage.name}] warning: {stage.init_from} did not finish; using its step "
        f"{meta.get('step')} checkpoint")
  say(f"[{stage.name}] initialised from {stage.init_from} step {meta.get('step')} ({prev_dir})"
      f"{', optimizer state kept' if stage.keep_optimizer_state else ''}")
  if stage.keep_optimizer_state:
    opt_state = jax.jit(reset_schedule_count, out_shardings=state_sh.opt_state)(state.opt_state)
  else:
    opt_state = jax.jit(tx.init, out_shardings=state_sh.opt_state)(state.params)
  step = jax.device_put(jnp.zeros((), jnp.int32), state_sh.step)
  return state.replace(step=step, opt_state=opt_state)


def _sample(graphdef, state, tokenizer, stage) -> str:
  prompt = tokenizer.encode(stage.sample_prompt)
  ids = generate(graphdef, state.params, state.model_vars, prompt,
                 max_new_tokens=stage.sample_tokens, temperature=0.0,
                 pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
  return tokenizer.decode(ids)


def _jsonable(x):
  return json.loads(json.dumps(x, default=str))
