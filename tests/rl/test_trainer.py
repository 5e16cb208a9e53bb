"""The RL trainer: config errors name the field; an interrupted SFT phase resumes exactly; a
phase does not resume under another config."""

import dataclasses
import shutil
import types

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.agentic_rl import PRESETS, apply_sets
from sparse_lm.config import get_preset
from sparse_lm.model.transformer import Transformer
from sparse_lm.rl import trainer
from sparse_lm.train import checkpoint as ckpt_lib


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
  # eval_every=-1 evaluated after every step ((step + 1) % -1 == 0); a string length compared
  # with an int; a negative seed reached numpy
  for field, value, want in (("eval_every", -1, "eval_every=-1 must be an integer >= 0"),
                             ("sft_steps", -1, "sft_steps=-1 must be"),
                             ("seed", -1, "seed=-1 must be"),
                             ("seq_len", "abc", "seq_len='abc' must be an integer > 0")):
    with pytest.raises(ValueError, match=want):
      dataclasses.replace(cfg, **{field: value}).validate()
  # the optimisers are checked with the rest (a bad grpo_optim surfaced after SFT, as "optim.")
  with pytest.raises(ValueError, match=r"grpo_optim.peak_lr=-1 must be > 0"):
    dataclasses.replace(cfg, grpo_optim=dataclasses.replace(cfg.grpo_optim, peak_lr=-1)
                        ).validate()
  # --set values take the preset's types, named on error (was "'>' not supported ...")
  for item, want in (("grpo.temperature=abc", "grpo.temperature='abc' must be a number"),
                     ("sft_optim.peak_lr=abc", "sft_optim.peak_lr='abc' must be a number"),
                     ("sft_steps=2.5", "sft_steps='2.5' must be an integer")):
    with pytest.raises(ValueError, match=want):
      apply_sets(cfg, [item])
  assert apply_sets(cfg, ["grpo.temperature=1"]).grpo.temperature == 1.0
  assert isinstance(apply_sets(cfg, ["grpo.temperature=1"]).grpo.temperature, float)


def test_url_workdir_or_init_from_is_refused_by_the_cli(capsys):
  from experiments import agentic_rl
  for args, want in ((["--workdir=gs://b/rl"], "--workdir='gs://b/rl' is a URL"),
                     (["--init_from=gs://b/runs", "--workdir=/tmp/x_rl"],
                      "--init_from='gs://b/runs' is a URL"),
                     (["--init-from=gs://b/runs", "--workdir=/tmp/x_rl"],  # the dashed form
                      "--init_from='gs://b/runs' is a URL")):
    with pytest.raises(SystemExit) as e:
      agentic_rl.main(["--preset=tiny", *args])
    assert e.value.code == 2
    assert want in capsys.readouterr().err


def test_cli_env_replaces_the_presets_env_settings(capsys):
  """`--preset small --env arithmetic` kept the passkey env's doc_chars and failed in
  ArithmeticEnv; the env's settings now go with the preset's env (here validation reaches the
  model config, past the env, and names its bad override)."""
  from experiments import agentic_rl
  with pytest.raises(SystemExit) as e:
    agentic_rl.main(["--preset=small", "--env=arithmetic", "--set",
                     'model_overrides=[["not_a_field", 1]]'])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "not_a_field" in err and "doc_chars" not in err


def test_lengths_fit_the_env_and_tokenizer(tmp_path):
  """The tiny preset's lengths (sized for arithmetic with its own tokenizer) grow to what
  another env needs: every sampled SFT transcript then fits sft_seq_len, and every prompt
  leaves max_turn_tokens of room in seq_len (a lookup transcript of 49 tokens stopped the run
  at sft_seq_len=32). Arithmetic keeps the recorded run's lengths."""
  from sparse_lm.rl import grpo, rollout
  cfg = PRESETS["tiny"]
  tok = trainer._tokenizer(cfg, tmp_path / "a", 512)  # pylint: disable=protected-access
  assert trainer.fit_lengths(cfg, tok) == cfg
  lookup = dataclasses.replace(cfg, env="lookup")
  tok = trainer._tokenizer(lookup, tmp_path / "l", 512)  # pylint: disable=protected-access
  lines = []
  fit = trainer.fit_lengths(lookup, tok, lines.append)
  assert fit.sft_seq_len > cfg.sft_seq_len and fit.sft_seq_len % 16 == 0
  assert "sft_seq_len=" in lines[0] and "(was 32)" in lines[0]
  env, rng = fit.env_instance(), np.random.default_rng(7)
  eps = []
  for _ in range(64):
    task = env.sample(rng)
    ids, gen = rollout.transcript(tok, task)
    assert len(rollout.prompt_ids(tok, task)) + fit.max_turn_tokens <= fit.seq_len
    eps.append(rollout.Episode(tokens=ids, generated=gen, logprobs=[0.0] * len(ids)))
  grpo.episodes_to_batch(eps, None, fit.sft_seq_len)  # raises if one does not fit
  with pytest.raises(ValueError, match="> seq_len=32"):
    grpo.episodes_to_batch(eps, None, cfg.sft_seq_len)


def test_init_from_without_checkpoints_is_refused_before_anything_runs(tmp_path, capsys):
  from experiments import agentic_rl
  with pytest.raises(SystemExit) as e:
    agentic_rl.main(["--preset=tiny", f"--init_from={tmp_path}", f"--workdir={tmp_path}/rl"])
  assert e.value.code == 2
  assert "holds no <stage>/checkpoints" in capsys.readouterr().err
  assert not (tmp_path / "rl").exists()
  (tmp_path / "stage_8k" / "checkpoints").mkdir(parents=True)
  assert trainer.pretraining_stages(str(tmp_path)) == [tmp_path / "stage_8k" / "checkpoints"]


def test_init_from_another_model_names_the_fields_and_model_overrides(tmp_path):
  """A pretraining checkpoint of another model (here 5 layers against the preset's) said "no
  readable checkpoint ... move the checkpoints aside", advice that would discard the
  pretraining run; it now names the differing field and the --set that matches."""
  cfg = dataclasses.replace(PRESETS["tiny"], init_from=str(tmp_path))
  other = Transformer(get_preset("tiny", num_layers=5), rngs=nnx.Rngs(0))
  _, _, state = trainer._fresh_state(other, trainer.OptimizerConfig(), 1, 0)
  ck = ckpt_lib.Checkpointer(tmp_path / "stage_8k" / "checkpoints", async_save=False)
  ck.save(state, data_state=None, meta={"model": ckpt_lib.to_json(other.cfg)})
  ck.close()
  model = Transformer(get_preset("tiny"), rngs=nnx.Rngs(0))
  with pytest.raises(ckpt_lib.ConfigMismatchError) as e:
    trainer._init_from_pretraining(model, cfg)
  msg = str(e.value)
  assert "num_layers" in msg and "model_overrides" in msg and "aside" not in msg, msg
  # and the matching model restores the checkpoint's weights
  same = Transformer(get_preset("tiny", num_layers=5), rngs=nnx.Rngs(1))
  got = trainer._init_from_pretraining(same, cfg)
  want = nnx.state(other, nnx.Param)
  for a, b in zip(jax.tree.leaves(nnx.state(got, nnx.Param)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
  # a SIGTERM during step 1 (between checkpoints): the phase saves step 1 and stops (it used
  # to die unsaved, losing the steps since the last checkpoint); the rerun ends where `full` did
  signal = types.SimpleNamespace(requested="SIGTERM")
  with pytest.raises(trainer.Preempted, match=r"\[sft\] SIGTERM: saved step 1 to .*run the "
                     "same command again to resume"):
    trainer.run_sft(cfg, tmp_path / "c", Transformer(model_cfg, rngs=nnx.Rngs(0)), tok,
                    preemption=signal)
  assert sorted(p.name for p in (tmp_path / "c" / "sft" / "checkpoints").iterdir()
                if p.name.isdigit()) == ["1"]
  again = trainer.run_sft(cfg, tmp_path / "c", Transformer(model_cfg, rngs=nnx.Rngs(3)), tok)
  for x, y in zip(jax.tree.leaves(nnx.state(full, nnx.Param)),
                  jax.tree.leaves(nnx.state(again, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_under_another_config_is_refused_naming_the_fields(tmp_path, monkeypatch, capsys):
  layers = (("num_layers", 3), ("mla_every", 2))
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=layers, sft_steps=1,
                            sft_batch=2, checkpoint_every=1, seq_len=48)
  model_cfg = get_preset("tiny", **dict(layers))
  tok = trainer._tokenizer(cfg, tmp_path, model_cfg.vocab_size)
  model = lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))
  trainer.run_sft(cfg, tmp_path, model(), tok)
  other = dataclasses.replace(cfg, seed=3, sft_batch=4)
  with pytest.raises(ckpt_lib.ConfigMismatchError) as e:
    trainer.run_sft(other, tmp_path, model(), tok)
  msg = str(e.value)
  assert "[sft]" in msg and "seed: 0 (saved) vs 3 (now)" in msg
  assert "sft_batch: 2 (saved) vs 4 (now)" in msg and "new --workdir" in msg
  # what is evaluated and how often it is saved may change: the finished phase is restored
  trainer.run_sft(dataclasses.replace(cfg, eval_tasks=7, eval_every=2, checkpoint_every=5),
                  tmp_path, model(), tok)
  # the CLI prints the message and exits 2 (no traceback)
  from experiments import agentic_rl, base
  def refuse(*a, **k):
    raise ckpt_lib.ConfigMismatchError(msg)
  monkeypatch.setattr(trainer, "run", refuse)
  monkeypatch.setattr(base, "enable_compilation_cache", lambda directory: None)
  assert agentic_rl.main(["--preset=tiny", f"--workdir={tmp_path}", "--no-progress"]) == 2
  assert "seed: 0 (saved) vs 3 (now)" in capsys.readouterr().err


def test_a_second_run_in_the_same_workdir_stops_at_once(tmp_path, capsys):
  """Two RL runs in one workdir appended to the same logs and checkpoints; the second now
  stops before building anything, naming the first."""
  from experiments import agentic_rl
  from sparse_lm.train.workdir import WorkdirLock
  with WorkdirLock(tmp_path):
    assert agentic_rl.main(["--preset=tiny", f"--workdir={tmp_path}", "--no-progress"]) == 1
  err = capsys.readouterr().err
  assert "is in use by another run: pid" in err, err
  assert not (tmp_path / "tokenizer.json").exists()
