"""The RL trainer: config errors name the field; an interrupted SFT phase resumes exactly."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.agentic_rl import PRESETS, apply_sets
from sparse_lm.config import get_preset
from sparse_lm.model.transformer import Transformer
from sparse_lm.rl import trainer


def test_config_errors_name_the_field():
  cfg = PRESETS["tiny"]
  with pytest.raises(ValueError, match="group_size"):
    dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, group_size=1)).validate()
  with pytest.raises(ValueError, match="RLConfig.env='chess'"):
    dataclasses.replace(cfg, env="chess").validate()
  with pytest.raises(ValueError, match="unknown --set key 'grpo_stepz'"):
    apply_sets(cfg, ["grpo_stepz=3"])
  out = apply_sets(cfg, ["grpo_steps=3", "grpo.kl_coef=0.05", "env=lookup"])
  assert (out.grpo_steps, out.grpo.kl_coef, out.env) == (3, 0.05, "lookup")


def test_init_from_without_checkpoints_is_refused_before_anything_runs(tmp_path, capsys):
  from experiments import agentic_rl
  with pytest.raises(SystemExit) as e:
    agentic_rl.main(["--preset=tiny", f"--init_from={tmp_path}", f"--workdir={tmp_path}/rl"])
  assert e.value.code == 2
  assert "holds no <stage>/checkpoints" in capsys.readouterr().err
  assert not (tmp_path / "rl").exists()
  (tmp_path / "stage_8k" / "checkpoints").mkdir(parents=True)
  assert trainer.pretraining_stages(str(tmp_path)) == [tmp_path / "stage_8k" / "checkpoints"]


def test_sft_resumes_exactly(tmp_path):
  # 3 layers (KDA, MLA, MLA; two MoE): what is checked is the resume, not the depth.
  layers = (("num_layers", 3), ("mla_every", 2))
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=layers, sft_steps=4,
                            sft_batch=4, checkpoint_every=2, seq_len=48)
  model_cfg = get_preset("tiny", **dict(layers))
  tok = trainer._tokenizer(cfg, tmp_path / "a", model_cfg.vocab_size)
  full = trainer.run_sft(cfg, tmp_path / "a", Transformer(model_cfg, rngs=nnx.Rngs(0)), tok)
  # an interrupted run: only the step-2 checkpoint exists; it resumes from there
  shutil.copytree(tmp_path / "a" / "sft" / "checkpoints" / "2",
                  tmp_path / "b" / "sft" / "checkpoints" / "2")
  resumed = trainer.run_sft(cfg, tmp_path / "b", Transformer(model_cfg, rngs=nnx.Rngs(1)), tok)
  for x, y in zip(jax.tree.leaves(nnx.state(full, nnx.Param)),
                  jax.tree.leaves(nnx.state(resumed, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
