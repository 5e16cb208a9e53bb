"""A checkpoint saved under one optimizer, continued under another (`optim.name` adamw ->
muon): a resume with --allow-config-change keeps the weights and the step and starts the new
optimizer's state fresh, its learning-rate schedule at the resumed step; a stage initialised
from it refuses to keep an optimizer state of another form unless told not to keep it. Both
used to fail as "no readable checkpoint ... move the checkpoints aside" (the restore target
was this run's optimizer-state tree).

No training and no compile of a step: the checkpoints are written from the small stage's fresh
state, and the starting state is what `loop._starting_state` returns."""

import dataclasses
import pathlib

import jax
import numpy as np
import optax
import pytest

from sparse_lm import sharding as shd
from sparse_lm.data import Tokenizer
from sparse_lm.train import checkpoint as ckpt_lib
from sparse_lm.train import loop
from sparse_lm.train.builder import build
from tests.train.conftest import small_stage


def _save(ckpt_dir: pathlib.Path, stage, state, step: int, tok: Tokenizer, final=False):
  ck = ckpt_lib.Checkpointer(ckpt_dir, keep=10, async_save=False)
  meta = ckpt_lib.make_meta(stage, tok.fingerprint, tok.to_json())
  if final:
    meta["final"] = True
  ck.save(state.replace(step=np.int32(step)), data_state={}, meta=meta)
  ck.close()


def _schedule_counts(opt_state) -> list[int]:
  found = [x for x in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
           if isinstance(x, optax.ScaleByScheduleState)]
  return [int(x.count) for x in found]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer_json):
  """A workdir with the small stage's AdamW checkpoint at step 5 whose weights, moments and
  schedule count are random (not the fresh state a wrong restore would also give)."""
  stage = small_stage()
  mesh = shd.make_mesh(shd.MeshLayout(), jax.devices()[:1])
  with shd.use_mesh(mesh):
    state = build(stage, mesh).init()
  leaves, treedef = jax.tree.flatten(state.params)
  keys = jax.random.split(jax.random.key(np.random.randint(1 << 30)), len(leaves))
  params = jax.tree.unflatten(treedef, [
      jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
  opt = ckpt_lib.set_schedule_count(
      jax.tree.map(lambda x: x + 0.5 if jnp_float(x) else x, state.opt_state), 5)
  state = state.replace(params=params, opt_state=opt)
  tok = Tokenizer.load(str(tokenizer_json))
  workdir = tmp_path_factory.mktemp("wd")
  _save(workdir / stage.name / "checkpoints", stage, state, 5, tok, final=True)
  return stage, state, mesh, tok, workdir


def jnp_float(x) -> bool:
  return hasattr(x, "dtype") and np.issubdtype(x.dtype, np.floating)


def _muon(stage, **changes):
  return dataclasses.replace(stage, optim=dataclasses.replace(stage.optim, name="muon"),
                             **changes)


def _start(stage, mesh, tok, workdir, ckpt_dir, allow):
  lines = []
  with shd.use_mesh(mesh, stage.mesh.rules):
    parts = build(stage, mesh)
    ckpt = ckpt_lib.Checkpointer(ckpt_dir, keep=10, async_save=False)
    try:
      state, _ = loop._starting_state(stage, workdir, mesh, parts, ckpt, tok, allow,
                                      lines.append)
    finally:
      ckpt.close()
  return state, parts, lines


def _assert_same_params(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_set_schedule_count_sets_only_the_schedule_counter(saved):
  stage, state, *_ = saved
  assert _schedule_counts(state.opt_state) == [5]
  moved = ckpt_lib.set_schedule_count(state.opt_state, 17)
  assert _schedule_counts(moved) == [17]
  assert _schedule_counts(ckpt_lib.reset_schedule_count(moved)) == [0]
  # Adam's own count and the moments are untouched.
  leaves = lambda t: [np.asarray(x) for x in jax.tree.leaves(t)]
  changed = [i for i, (x, y) in enumerate(zip(leaves(state.opt_state), leaves(moved)))
             if not np.array_equal(x, y)]
  assert len(changed) == 1, changed


def test_resume_under_another_optimizer_keeps_weights_and_step(saved):
  stage, state, mesh, tok, workdir = saved
  muon = _muon(stage)
  ckpt_dir = workdir / stage.name / "checkpoints"
  with pytest.raises(ckpt_lib.ConfigMismatchError, match="optim.name"):
    _start(muon, mesh, tok, workdir, ckpt_dir, allow=False)
  got, parts, lines = _start(muon, mesh, tok, workdir, ckpt_dir, allow=True)
  assert int(got.step) == 5
  _assert_same_params(got.params, state.params)
  # The new optimizer's own state tree, fresh (zero momentum), its schedule at step 5.
  assert jax.tree.structure(got.opt_state) == jax.tree.structure(parts.abstract_state.opt_state)
  assert jax.tree.structure(got.opt_state) != jax.tree.structure(state.opt_state)
  counts = _schedule_counts(got.opt_state)  # Muon's and the AdamW part's
  assert len(counts) == 2 and set(counts) == {5}, counts
  fresh = jax.tree.leaves(jax.jit(parts.tx.init)(got.params))
  for x, y in zip(jax.tree.leaves(got.opt_state), fresh):
    if np.asarray(y).ndim > 0:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  text = "\n".join(lines)
  assert "resuming from step 5" in text and "optimizer state starts fresh" in text, text
  assert "optim.name='adamw'" in text and "optim.name='muon'" in text, text
  # Nothing was set aside as unreadable.
  assert ckpt_lib.Checkpointer(ckpt_dir).all_steps() == [5]
  assert not (workdir / stage.name / ckpt_lib.UNREADABLE_DIR).exists()


def test_resume_under_the_same_optimizer_keeps_its_state(saved):
  stage, state, mesh, tok, workdir = saved
  got, _, lines = _start(stage, mesh, tok, workdir, workdir / stage.name / "checkpoints",
                         allow=False)
  _assert_same_params(got.opt_state, state.opt_state)
  assert not any("starts fresh" in l for l in lines), lines


def test_init_from_a_stage_trained_with_another_optimizer(saved, tmp_path):
  stage, state, mesh, tok, workdir = saved
  nxt = _muon(stage, name="next_stage", init_from=stage.name)
  ckpt_dir = tmp_path / "next" / "checkpoints"
  with pytest.raises(ckpt_lib.ConfigMismatchError, match="keep_optimizer_state=false"):
    _start(nxt, mesh, tok, workdir, ckpt_dir, allow=False)
  got, parts, _ = _start(dataclasses.replace(nxt, keep_optimizer_state=False), mesh, tok,
                         workdir, ckpt_dir, allow=False)
  assert int(got.step) == 0
  _assert_same_params(got.params, state.params)
  assert jax.tree.structure(got.opt_state) == jax.tree.structure(parts.abstract_state.opt_state)
  assert _schedule_counts(got.opt_state) == [0, 0]
