"""`sparse_lm.train.load` over an unreadable newest step: the stage config it returns, and the
model it builds, are those saved with the step it actually restored (it used to return the
newest step's config, read from a meta that was readable although the step's arrays were not).

No training and no compile: the checkpoints are written from the small stage's fresh state."""

import dataclasses
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

import sparse_lm.train
from sparse_lm import sharding as shd
from sparse_lm.data import Tokenizer
from sparse_lm.train import checkpoint as ckpt_lib
from sparse_lm.train.builder import build
from tests import checkpoint_testlib
from tests.train.conftest import small_stage


def _save(ckpt_dir: pathlib.Path, stage, state, step: int, tokenizer: Tokenizer) -> None:
  ck = ckpt_lib.Checkpointer(ckpt_dir, keep=10, async_save=False)
  ck.save(state.replace(step=np.int32(step)), data_state={},
          meta=ckpt_lib.make_meta(stage, tokenizer.fingerprint, tokenizer.to_json()))
  ck.close()


@pytest.fixture(scope="module")
def fresh():
  """(stage, its fresh TrainState, mesh) of the small stage on one device."""
  stage = small_stage()
  mesh = shd.make_mesh(shd.MeshLayout(), jax.devices()[:1])
  with shd.use_mesh(mesh):
    state = build(stage, mesh).init()
  return stage, state, mesh


def _param_leaves(model):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_fallback_returns_the_restored_steps_stage_config(tmp_path, tokenizer_json, fresh):
  """Step 2 written as stage `a`; step 4 (resumed with a changed eval_every, a change that
  resumes without --allow-config-change) written as `b` and then truncated: load restores
  step 2 and returns `a`, the config saved with step 2, not `b`."""
  stage, state, _ = fresh
  tok = Tokenizer.load(str(tokenizer_json))
  a = stage
  b = dataclasses.replace(stage, eval_every=3, checkpoint_every=1)
  assert ckpt_lib.check_resume(ckpt_lib.make_meta(a, "x", "{}"), b) != []  # benign changes
  ckpt_dir = tmp_path / stage.name / "checkpoints"
  _save(ckpt_dir, a, state, 2, tok)
  newer = state.replace(params=jax.tree.map(lambda x: x + 1, state.params))
  _save(ckpt_dir, b, newer, 4, tok)
  checkpoint_testlib.truncate_arrays(ckpt_dir / "4")
  with pytest.warns(RuntimeWarning, match="falling back to the previous one"):
    model, tokenizer, saved = sparse_lm.train.load(tmp_path, stage.name)
  assert saved == a and saved != b
  assert tokenizer.fingerprint == tok.fingerprint
  for x, y in zip(_param_leaves(model), [np.asarray(v) for v in jax.tree.leaves(state.params)]):
    np.testing.assert_array_equal(x, y)
  # nothing moved: load only reads
  assert ckpt_lib.Checkpointer(ckpt_dir).all_steps() == [2, 4]


def test_fallback_restores_a_step_saved_with_another_optimizer(tmp_path, tokenizer_json, fresh):
  """Step 2 written with AdamW; the run resumed with --allow-config-change and
  optim.name=muon (another optimizer-state tree) and wrote step 4, then truncated. Step 2 is
  readable and must restore into its own (AdamW) state tree: load used to build the restore
  target from step 4's config, so step 2 failed too and nothing could be loaded."""
  stage, state, mesh = fresh
  tok = Tokenizer.load(str(tokenizer_json))
  muon = dataclasses.replace(stage, optim=dataclasses.replace(stage.optim, name="muon"))
  with shd.use_mesh(mesh):
    muon_state = build(muon, mesh).init()
  # other weights than step 2's, so that the comparisons below tell the two steps apart
  muon_state = muon_state.replace(params=jax.tree.map(lambda x: x + 1, muon_state.params))
  assert (jax.tree.structure(muon_state.opt_state) != jax.tree.structure(state.opt_state))
  ckpt_dir = tmp_path / stage.name / "checkpoints"
  _save(ckpt_dir, stage, state, 2, tok)
  _save(ckpt_dir, muon, muon_state, 4, tok)
  checkpoint_testlib.truncate_arrays(ckpt_dir / "4")
  with pytest.warns(RuntimeWarning, match="falling back to the previous one"):
    model, _, saved = sparse_lm.train.load(tmp_path, stage.name)
  assert saved == stage and saved.optim.name == "adamw"
  for x, y in zip(_param_leaves(model), [np.asarray(v) for v in jax.tree.leaves(state.params)]):
    np.testing.assert_array_equal(x, y)
  # With step 4 readable it is the one loaded, with its own config.
  _save(tmp_path / "other" / stage.name / "checkpoints", muon, muon_state, 4, tok)
  model, _, saved = sparse_lm.train.load(tmp_path / "other", stage.name)
  assert saved == muon
  for x, y in zip(_param_leaves(model),
                  [np.asarray(v) for v in jax.tree.leaves(muon_state.params)]):
    np.testing.assert_array_equal(x, y)
