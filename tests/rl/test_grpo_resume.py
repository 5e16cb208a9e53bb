"""A resumed GRPO phase is the uninterrupted one: its KL reference is the frozen SFT policy (it
was the restored GRPO weights, so the resumed steps logged kl 0.0), and one finished SFT phase
serves GRPO runs under other GRPO settings."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.agentic_rl import PRESETS
from sparse_lm.config import get_preset
from sparse_lm.inference import Engine
from sparse_lm.model.transformer import Transformer
from sparse_lm.rl import trainer
from sparse_lm.train import checkpoint as ckpt_lib

# 3 layers (KDA, MLA, MLA; one MoE), the standard residual: what is checked is the resume, and
# this model compiles fastest (tests/rl/test_grpo_learns.py)
LAYERS = (("num_layers", 3), ("mla_every", 2), ("residual", "standard"),
          ("num_dense_layers", 2))


def _params(model) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_resumed_grpo_keeps_the_sft_policy_as_kl_reference(tmp_path, monkeypatch):
  cfg = dataclasses.replace(
      PRESETS["tiny"], model_overrides=LAYERS, sft_steps=2, sft_batch=4, checkpoint_every=2,
      grpo_steps=3, prompts_per_step=2,
      grpo=dataclasses.replace(PRESETS["tiny"].grpo, group_size=2, kl_coef=0.05))
  model_cfg = get_preset("tiny", **dict(LAYERS))
  tok = trainer._tokenizer(cfg, tmp_path, model_cfg.vocab_size)  # pylint: disable=protected-access
  cfg = trainer.fit_lengths(cfg, tok)
  refs = []  # the reference (params, model_vars) each GRPO step's batch was scored against
  batch_fn = trainer.grpo_batch

  def record(eps, rewards, cfg, logp_fn, state, ref=None):
    refs.append([np.asarray(x) for x in jax.tree.leaves(ref[0])])
    return batch_fn(eps, rewards, cfg, logp_fn, state, ref)

  monkeypatch.setattr(trainer, "grpo_batch", record)
  a, b = tmp_path / "a", tmp_path / "b"
  sft = trainer.run_sft(cfg, a, Transformer(model_cfg, rngs=nnx.Rngs(0)), tok)
  sft_params = _params(sft)  # before GRPO: its first step donates these buffers
  engine = Engine(sft, max_length=cfg.seq_len, max_batch=4)
  _, full = trainer.run_grpo(cfg, a, sft, tok, engine)
  # an interrupted run: SFT finished, GRPO saved step 2 of 3; SFT is restored, GRPO resumes
  shutil.copytree(a / "sft" / "checkpoints", b / "sft" / "checkpoints")
  shutil.copytree(a / "grpo" / "checkpoints" / "2", b / "grpo" / "checkpoints" / "2")
  sft_b = trainer.run_sft(cfg, b, Transformer(model_cfg, rngs=nnx.Rngs(1)), tok)
  _, resumed = trainer.run_grpo(cfg, b, sft_b, tok, engine)
  assert len(full) == 3 and len(resumed) == 1 and len(refs) == 4
  # the resumed step is the uninterrupted step 3 (it logged kl 0.0: the reference was the
  # policy itself)
  assert full[2]["kl"] > 0
  for key in ("kl", "loss", "reward"):
    np.testing.assert_allclose(resumed[0][key], full[2][key], rtol=1e-5, err_msg=key)
  for ref in refs:  # every step, the resumed one included, is scored against the SFT policy
    for x, y in zip(ref, sft_params):
      np.testing.assert_array_equal(x, y)
  # one SFT serves other GRPO settings: a finished SFT phase is restored under them (it said
  # "[sft] ... grpo_steps: 3 (saved) vs 4 (now)"); the GRPO phase itself still refuses them
  other = dataclasses.replace(
      cfg, grpo_steps=4, prompts_per_step=3, partial_credit=0.5, max_turn_tokens=16,
      grpo=dataclasses.replace(cfg.grpo, kl_coef=0.0, clip_high=0.28),
      grpo_optim=dataclasses.replace(cfg.grpo_optim, peak_lr=1e-4))
  again = trainer.run_sft(other, b, Transformer(model_cfg, rngs=nnx.Rngs(2)), tok)
  for x, y in zip(_params(again), sft_params):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ckpt_lib.ConfigMismatchError, match=r"\[grpo\].*grpo_steps: 3 \(saved\) "
                     r"vs 4 \(now\)"):
    trainer.run_grpo(other, b, again, tok, engine)
