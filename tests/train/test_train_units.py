"""Unit tests of the training pieces that need no model compile: schedule, decay mask,
checkpoint fallback on a truncated checkpoint, tokenizer check, schedule reset."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.train import checkpoint as ckpt_lib
from sparse_lm.train.optimizer import OptimizerConfig, decay_mask, make_optimizer, wsd_schedule
from sparse_lm.train.state import TrainState


def test_wsd_schedule_shape():
  cfg = OptimizerConfig(peak_lr=1.0, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
  lr = np.array([float(wsd_schedule(cfg, 100)(s)) for s in range(100)])
  np.testing.assert_allclose(lr[:10], (np.arange(10) + 1) / 10, rtol=1e-6)  # linear warmup
  np.testing.assert_allclose(lr[10:80], 1.0)  # stable
  assert np.all(np.diff(lr[80:]) < 0) and lr[-1] == pytest.approx(0.1 + 0.9 / 20, rel=1e-5)
  assert float(wsd_schedule(cfg, 100)(100)) == pytest.approx(0.1)  # decayed to the floor


def test_decay_mask_on_the_model_param_names():
  from sparse_lm.model.transformer import Transformer
  model = nnx.eval_shape(lambda: Transformer(get_preset("tiny"), rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  mask = decay_mask(params)
  names = {}
  for path, flag in jax.tree_util.tree_flatten_with_path(mask)[0]:
    names["/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)] = flag
  no_decay = [n for n, f in names.items() if not f]
  decay = [n for n, f in names.items() if f]
  for needle in ("A_log", "dt_bias", "attn_norm", "ffn_query", "final_query", "latent_norm",
                 "final_norm"):
    assert any(needle in n for n in no_decay), needle
    assert not any(needle in n for n in decay), needle
  for needle in ("mixer/w_q", "expert_up", "embed", "lm_head", "router"):
    assert any(needle in n for n in decay), needle


def _toy_state(seed: int, tx) -> TrainState:
  k = jax.random.PRNGKey(seed)
  params = nnx.State({"w": nnx.Param(jax.random.normal(k, (8, 4))),
                      "norm": nnx.Param(jnp.ones((4,)))})
  return TrainState(step=jnp.asarray(seed, jnp.int32), params=params,
                    model_vars=nnx.State({"bias": nnx.Variable(jnp.arange(3.0) + seed)}),
                    opt_state=tx.init(params), rng=jax.random.PRNGKey(seed + 1))


def test_truncated_checkpoint_falls_back_to_previous(tmp_path: pathlib.Path):
  tx = make_optimizer(OptimizerConfig(), 10)
  ck = ckpt_lib.Checkpointer(tmp_path / "ck", keep=3)
  meta = {"tokenizer": {"fingerprint": "abc"}}
  for step in (1, 2):
    ck.save(_toy_state(step, tx), data_state={"pos": step}, meta=meta)
  ck.wait()
  for f in (tmp_path / "ck" / "2" / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 64 and "d" in f.parent.name:
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # a truncated write
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=x.sharding), _toy_state(0, tx))
  ck2 = ckpt_lib.Checkpointer(tmp_path / "ck", keep=3)
  with pytest.warns(RuntimeWarning, match="falling back to the previous one"):
    state, data_state, meta_out = ck2.restore_latest(target)
  assert int(state.step) == 1 and data_state == {"pos": 1}
  np.testing.assert_array_equal(state.params["w"][...], _toy_state(1, tx).params["w"][...])
  assert meta_out["tokenizer"]["fingerprint"] == "abc"
  # Issue 12.1: the unreadable step was moved aside, so it is saved again when retrained.
  assert ck2.all_steps() == [1]
  aside = list((tmp_path / ckpt_lib.UNREADABLE_DIR).iterdir())
  assert [p.name.split("-")[0] for p in aside] == ["2"]
  ck2.save(_toy_state(2, tx), data_state={"pos": 22}, meta=meta)
  ck2.wait()
  ck3 = ckpt_lib.Checkpointer(tmp_path / "ck", keep=3)
  state, data_state, _ = ck3.restore_latest(target)
  assert int(state.step) == 2 and data_state == {"pos": 22}
  ck.close()
  ck2.close()
  ck3.close()


def test_tokenizer_mismatch_is_an_error():
  ckpt_lib.check_tokenizer({"tokenizer": {"fingerprint": "abc"}}, "abc", "x")
  with pytest.raises(ckpt_lib.TokenizerMismatchError, match="abc.*def"):
    ckpt_lib.check_tokenizer({"tokenizer": {"fingerprint": "abc"}}, "def", "checkpoint x")


def test_reset_schedule_count_keeps_adam_count():
  tx = make_optimizer(OptimizerConfig(warmup_steps=5), 20)
  params = {"w": jnp.ones((3, 3))}
  opt = tx.init(params)
  for _ in range(3):
    _, opt = tx.update({"w": jnp.ones((3, 3))}, opt, params)
  reset = ckpt_lib.reset_schedule_count(opt)
  counts = lambda o, cls: [x.count for x in jax.tree.leaves(
      o, is_leaf=lambda x: isinstance(x, cls)) if isinstance(x, cls)]
  assert [int(c) for c in counts(reset, optax.ScaleByScheduleState)] == [0]
  assert [int(c) for c in counts(reset, optax.ScaleByAdamState)] == [3]


def test_data_positions_are_kept_per_row_group():
  saved = ckpt_lib.data_item({"pos": 7}, 0)  # one process: its own row group
  assert saved == {"shards": {"0": {"pos": 7}}}
  assert ckpt_lib.shard_state(saved, 0) == {"pos": 7}
  assert ckpt_lib.shard_state({"pos": 3}, 0) == {"pos": 3}  # the earlier one-process format
  assert ckpt_lib.shard_state(None, 0) is None
  with pytest.raises(ValueError, match="row groups \\['0'\\], not 1"):
    ckpt_lib.shard_state(saved, 1)
