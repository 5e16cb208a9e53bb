"""`build(stage, mesh)`: what a stage compiles (model graph, optimizer, sharded abstract state,
jitted train and eval steps), cached per configuration in the process.

The training loop (`loop.run`), the ahead-of-time planner and `sparse_lm.train.load` build a
stage's parts here, so there is one build of the train step.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sparse_lm import sharding as shd
from sparse_lm.model.loss import loss_fn
from sparse_lm.model.transformer import Transformer
from sparse_lm.moe.balancing import update_balancers
from sparse_lm.train.config import StageConfig
from sparse_lm.train.optimizer import make_optimizer, qk_clip, wsd_schedule
from sparse_lm.train.state import TrainState, graphdef_of, make_init_fn
from sparse_lm.train.step import make_eval_step, make_train_step

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
# With `data.images`: packed encoder patches [B, L, p*p*3], their segment ids [B, L] and
# patch coordinates [B, L, 2] (sparse_lm/data/images.py), sharded like the rows.
IMAGE_BATCH_KEYS = {"image_patches": 3, "image_segment_ids": 2, "image_coords": 3}


def batch_shapes(stage: StageConfig, rows: int, seq_len: int) -> dict[str, tuple]:
  """{batch key: (shape, dtype name)} of a [rows, seq_len] batch of `stage` (its image keys
  too when `stage.data.images`), e.g. for AOT lowering with ShapeDtypeStructs."""
  out = {k: ((rows, seq_len), "float32" if k == "loss_mask" else "int32") for k in BATCH_KEYS}
  if stage.data.images:
    p = stage.model_config().vision_patch_size
    L = stage.data.image_patches_per_row or seq_len
    out.update(image_patches=((rows, L, p * p * 3), "uint8"),
               image_segment_ids=((rows, L), "int32"), image_coords=((rows, L, 2), "int32"))
  return out


def _model_factory(stage: StageConfig) -> Callable[[int], nnx.Module]:
  model_cfg = stage.model_config()
  return lambda seed: Transformer(model_cfg, rngs=nnx.Rngs(seed))


def _post_update_fn(model_cfg, optim) -> Callable | None:
  """What the train step runs on the model after the optimizer update: the balancers' bias
  update (§6 step 5) and QK-clip (optimizer.qk_clip), each when configured; returns metrics."""
  fns = []
  if model_cfg.balancer != "none":
    fns.append(update_balancers)
  if model_cfg.mla_logit_max:
    tau = optim.qk_clip_threshold
    fns.append(lambda model: qk_clip(model, float("inf") if tau is None else tau))
  if not fns:
    return None
  return lambda model: {k: v for fn in fns for k, v in (fn(model) or {}).items()}


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
    with shd.use_mesh(mesh, stage.mesh.rules):
      return fn(*args)
  return traced


def import_gpu_kernels() -> None:
  """On a GPU, import the kernel libraries the model imports at first use (tokamax: attention
  and grouped matmuls; Pallas Triton and Mosaic GPU: KDA) before anything is traced.

  Importing them registers JAX config options, and a trace's cache key holds the value of
  every option: a program traced before the import misses the cache after it and is traced
  and compiled again (seen on an H200: the eval step compiled twice, 10.9 s more).
  """
  if jax.default_backend() != "gpu":
    return
  for name in ("tokamax", "jax.experimental.pallas.triton",
               "jax.experimental.pallas.mosaic_gpu"):
    try:
      importlib.import_module(name)
    except ImportError:  # not installed: the model does not pick it
      pass


def compiler_options(stage: StageConfig, mesh: jax.sharding.Mesh) -> dict[str, int] | None:
  """XLA options for the stage's train and eval steps: `{"xla_gpu_autotune_level": 0}` when
  the mesh is on GPUs and `stage.gpu_autotune` is False, else None (XLA's defaults)."""
  on_gpu = mesh.devices.flat[0].platform == "gpu"
  return {"xla_gpu_autotune_level": 0} if on_gpu and not stage.gpu_autotune else None


def build(stage: StageConfig, mesh: jax.sharding.Mesh) -> Parts:
  """The model graph, optimizer, abstract state with shardings and the jitted steps."""
  import_gpu_kernels()
  key = (stage.model_config(), stage.optim, stage.steps, stage.micro_batches,
         stage.z_loss_coef, stage.nan_at_step, stage.seed, mesh, stage.mesh.rules,
         stage.gpu_autotune)
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
  balance = _post_update_fn(model_cfg, stage.optim)
  options = compiler_options(stage, mesh)
  train_step = jax.jit(
      _traced_in(stage, mesh, make_train_step(
          graphdef, tx, schedule, loss_fn, micro_batches=stage.micro_batches,
          z_loss_coef=stage.z_loss_coef, balance_fn=balance, nan_at_step=stage.nan_at_step)),
      in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl), donate_argnums=0,
      compiler_options=options)
  eval_fn = _traced_in(stage, mesh, make_eval_step(graphdef, loss_fn))
  eval_step = jax.jit(eval_fn, in_shardings=(state_sh, batch_sh), out_shardings=repl,
                      compiler_options=options)
  if mesh.size == 1:
    # One device: initialise op by op (compiling the init program of a small model takes
    # longer than running it); on a real mesh the jitted init places every shard directly.
    init_fn = lambda: jax.device_put(init(), state_sh)
  else:
    init_fn = jax.jit(init, out_shardings=state_sh)
  parts = Parts(graphdef, tx, init_fn, abstract, state_sh, batch_sh, train_step, eval_step)
  _PARTS[key] = parts
  return parts
