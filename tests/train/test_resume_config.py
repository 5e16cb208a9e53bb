"""Resuming compares the configs saved in the checkpoint with the run's (issue 12.1, 12.3):
a model mismatch is not corruption, an optimisation change stops unless allowed."""

import dataclasses
import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from experiments import stage_8k, stage_64k
from experiments.base import apply_overrides
from sparse_lm.train import checkpoint as ckpt_lib
from sparse_lm.train.optimizer import OptimizerConfig, make_optimizer
from sparse_lm.train.state import TrainState


def _toy_state(seed: int, tx) -> TrainState:
  params = nnx.State({"w": nnx.Param(jax.random.normal(jax.random.PRNGKey(seed), (8, 4)))})
  return TrainState(step=jnp.asarray(seed, jnp.int32), params=params,
                    model_vars=nnx.State({"bias": nnx.Variable(jnp.arange(3.0) + seed)}),
                    opt_state=tx.init(params), rng=jax.random.PRNGKey(seed + 1))


def test_a_model_config_mismatch_stops_without_walking_back(tmp_path: pathlib.Path):
  tx = make_optimizer(OptimizerConfig(), 10)
  stage = stage_8k.TINY
  ck = ckpt_lib.Checkpointer(tmp_path / "ck", keep=3)
  for step in (1, 2):
    ck.save(_toy_state(step, tx), data_state={}, meta=ckpt_lib.make_meta(stage, "abc", "{}"))
  ck.close()
  other = apply_overrides(stage, ["model.num_layers=5"])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        _toy_state(0, tx))
  ck2 = ckpt_lib.Checkpointer(tmp_path / "ck", keep=3)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no "falling back" warning: nothing is walked back
    with pytest.raises(ckpt_lib.ConfigMismatchError,
                       match=r"step 2: num_layers: 9 \(saved\) vs 5 \(now\).*use a new workdir"):
      ck2.restore_latest(target, check_meta=lambda m: ckpt_lib.check_resume(m, other))
  assert ck2.all_steps() == [1, 2] and not (tmp_path / ckpt_lib.UNREADABLE_DIR).exists()
  ck2.close()


def test_resume_compares_the_saved_stage_config():
  """A 30-step run stopped at 18 and resumed with --steps=24 --set optim.peak_lr=1e-2 stops
  and lists both differences (it used to jump the learning rate silently)."""
  saved = apply_overrides(stage_8k.TINY, ["steps=30"])
  meta = {**ckpt_lib.make_meta(saved, "abc", "{}"), "step": 18}
  assert ckpt_lib.check_resume(meta, saved) == []
  changed = apply_overrides(saved, ["steps=24", "optim.peak_lr=1e-2", "eval_every=7"])
  with pytest.raises(ckpt_lib.ConfigMismatchError) as e:
    ckpt_lib.check_resume(meta, changed)
  msg = str(e.value)
  assert "step 18" in msg and "steps: 30 (saved) vs 24 (now)" in msg
  assert "optim.peak_lr: 0.003 (saved) vs 0.01 (now)" in msg and "eval_every" not in msg
  assert "--allow-config-change" in msg
  notes = ckpt_lib.check_resume(meta, changed, allow_config_change=True)
  assert notes == ["optim.peak_lr: 0.003 -> 0.01", "steps: 30 -> 24", "eval_every: 100 -> 7"]
  # Reporting, layout and implementation choices resume with a note only.
  benign = apply_overrides(saved, ["eval_every=7", "checkpoint_every=3", "mesh=fsdp=-1,expert=1",
                                   "model.remat_policy=full", "micro_batches=2"])
  assert sorted(ckpt_lib.check_resume(meta, benign)) == [
      "checkpoint_every: 100 -> 3", "eval_every: 100 -> 7", "micro_batches: 1 -> 2",
      "model.remat_policy: 'none' -> 'full'"]
  for sets in (["tokens_per_batch=4096"], ["data.seed=3"], ["z_loss_coef=0"],
               ["optim.warmup_steps=7"], ["seq_len=128"]):
    with pytest.raises(ckpt_lib.ConfigMismatchError):
      ckpt_lib.check_resume(meta, apply_overrides(saved, sets))
  with pytest.raises(ckpt_lib.ConfigMismatchError, match="use a new workdir"):
    ckpt_lib.check_resume(meta, apply_overrides(saved, ["model.d_model=32"]),
                          allow_config_change=True)
  # Another preset: the message says so before listing its fields.
  small = dataclasses.replace(stage_8k.STAGES["small"], steps=30)
  with pytest.raises(ckpt_lib.ConfigMismatchError,
                     match=r"the checkpoint holds a .tiny. model and this run builds .small. "
                           r"\(--preset=tiny resumes it\); "
                           r"the model config differs"):
    ckpt_lib.check_resume(meta, small, allow_config_change=True)


def test_stage_config_round_trips_through_the_checkpoint_json():
  tiny_64k = apply_overrides(stage_64k.STAGES["tiny"], ["model.num_layers=5",
                                                        "mesh=fsdp=-1,context=2"])
  for stage in (stage_8k.FULL, tiny_64k):
    back = ckpt_lib.stage_from_json(json.loads(json.dumps(ckpt_lib.to_json(stage))))
    assert back == stage
    assert dataclasses.asdict(back) == dataclasses.asdict(stage)
