"""The RL trainer's guards: lengths that fit every reference turn, a pretraining workdir refused
as --workdir, init_from's empty stages and RL workdirs, a changed config refused before any
eval, a GRPO resume that keeps its eval curve, and the messages and log lines that say so."""
# pylint: disable=protected-access

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.agentic_rl import PRESETS
from sparse_lm.config import get_preset
from sparse_lm.model.transformer import Transformer
from sparse_lm.rl import rollout, trainer
from sparse_lm.train import checkpoint as ckpt_lib
from sparse_lm.train import loop

# 3 layers (KDA, MLA, MLA): what is checked is the trainer, not the depth
LAYERS = (("num_layers", 3), ("mla_every", 2))


def _params(model) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _save(directory, state, meta, final=True):
  ck = ckpt_lib.Checkpointer(directory, async_save=False)
  ck.save(state, data_state=None, meta=meta, final=final)
  ck.close()


def _tiny_state(step: int) -> trainer.TrainState:
  """A stand-in state: the checks under test read a checkpoint's meta only."""
  return trainer.TrainState(step=jnp.asarray(step, jnp.int32), params={"w": jnp.zeros(2)},
                            model_vars={}, opt_state=(), rng=jax.random.PRNGKey(0))


def _no_training(monkeypatch):
  """The old code went on into SFT (and its eval): fail there at once instead of training."""
  def ran(*a, **k):
    raise AssertionError("the run reached SFT / an eval")
  monkeypatch.setattr(trainer, "run_sft", ran)
  monkeypatch.setattr(trainer, "evaluate", ran)
  from experiments import base
  monkeypatch.setattr(base, "enable_compilation_cache", lambda directory: None)


def test_max_turn_tokens_and_seq_len_fit_every_reference_turn(tmp_path):
  """A model turn longer than max_turn_tokens never closes its call (the code env's turns,
  25-32 tokens, against the tiny preset's 24: no episode could succeed); fit_lengths now raises
  max_turn_tokens as it raises the other lengths, and seq_len leaves max_turn_tokens of room
  at the start of every reference turn, the final answer's too (a lookup answer starting at
  token 45 had 64 - 45 < 24: the episode ended before its answer)."""
  cfg = PRESETS["tiny"]
  bpe = []
  tok = trainer._tokenizer(cfg, tmp_path / "a", 512, bpe.append)
  short = dataclasses.replace(cfg, max_turn_tokens=4)
  lines = []
  fit = trainer.fit_lengths(short, tok, lines.append)
  assert fit.max_turn_tokens > 4 and fit.max_turn_tokens % 16 == 0
  assert f"max_turn_tokens={fit.max_turn_tokens} (was 4)" in lines[0], lines
  env, rng = fit.env_instance(), np.random.default_rng(3)
  turns = [n for _ in range(64)
           for _, n in trainer._turns(rollout.transcript(tok, env.sample(rng))[1])]
  assert 4 < max(turns) <= fit.max_turn_tokens
  lookup = dataclasses.replace(cfg, env="lookup")
  tok = trainer._tokenizer(lookup, tmp_path / "l", 512)
  fit = trainer.fit_lengths(lookup, tok)
  env, rng = fit.env_instance(), np.random.default_rng(11)
  for _ in range(128):
    _, gen = rollout.transcript(tok, env.sample(rng))
    for start, length in trainer._turns(gen):
      assert length <= fit.max_turn_tokens
      assert start + fit.max_turn_tokens <= fit.seq_len, (start, fit)
  # the BPE line names the sandbox's minutes for the code env only (it did for every env)
  assert "arithmetic" in bpe[0] and "sandbox" not in bpe[0], bpe


def test_a_pretraining_workdir_is_refused_as_the_rl_workdir(tmp_path, monkeypatch, capsys):
  """`--workdir` at a pretraining workdir was accepted: the RL run started from random weights,
  reused its tokenizer.json and wrote sft/ and grpo/ beside the stages. It is now refused before
  anything is written there, naming the stage and `--init_from`."""
  from experiments import agentic_rl
  _no_training(monkeypatch)
  pre = tmp_path / "pre"
  (pre / "stage_8k" / "checkpoints" / "100").mkdir(parents=True)
  with pytest.raises(SystemExit) as e:  # refused by the CLI before anything is built
    agentic_rl.main(["--preset=tiny", f"--workdir={pre}", "--no-progress"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"{pre}/stage_8k/checkpoints" in err and f"--init_from {pre}" in err, err
  assert "fresh --workdir" in err
  assert sorted(p.name for p in pre.iterdir()) == ["stage_8k"]  # no run.lock, tokenizer, sft/
  with pytest.raises(trainer.NotAnRLWorkdirError):
    trainer.run(PRESETS["tiny"], str(pre))
  # a stage that has not saved yet: refused too, without the --init_from advice
  (tmp_path / "new" / "stage_8k" / "checkpoints").mkdir(parents=True)
  with pytest.raises(trainer.NotAnRLWorkdirError, match="holds no saved step yet"):
    trainer.check_rl_workdir(tmp_path / "new")
  # an RL workdir (its phases only) is fine
  for phase in ("sft", "grpo"):
    (tmp_path / "rl" / phase / "checkpoints" / "4").mkdir(parents=True)
  trainer.check_rl_workdir(tmp_path / "rl")


def test_init_from_an_empty_stage_or_an_rl_workdir(tmp_path, monkeypatch, capsys):
  """A pretraining run stopped before its first save left an empty `<stage>/checkpoints`,
  which raised a raw FileNotFoundError inside run(); it is now refused by the CLI before
  anything runs, naming the directory and the fix, and passed over (said in the log) when an
  older stage has a checkpoint. An RL workdir as init_from gives its newest phase's policy
  (its tokenizer from the checkpoint when the workdir has no tokenizer.json), and the log
  names the stage or phase and the step the weights came from."""
  from experiments import agentic_rl
  _no_training(monkeypatch)
  pre = tmp_path / "pre"
  (pre / "stage_8k" / "checkpoints").mkdir(parents=True)
  with pytest.raises(SystemExit) as e:
    agentic_rl.main(["--preset=tiny", f"--init_from={pre}", f"--workdir={tmp_path}/rl"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"{pre}/stage_8k/checkpoints holds no checkpoint yet" in err, err
  assert "init_from unset" in err
  assert not any((tmp_path / "rl").glob("*"))  # the CLI may create it; nothing is written
  # an older stage with a checkpoint: used, and the empty newer one is named in the log
  model_cfg = get_preset("tiny", **dict(LAYERS))
  saved = Transformer(model_cfg, rngs=nnx.Rngs(0))
  _, _, state = trainer._fresh_state(saved, trainer.OptimizerConfig(), 1, 0)
  old = tmp_path / "old"
  _save(old / "stage_a" / "checkpoints", state.replace(step=jnp.asarray(7, jnp.int32)),
        {"stage": {"name": "stage_a"}, "model": ckpt_lib.to_json(model_cfg)})
  (old / "stage_b" / "checkpoints").mkdir(parents=True)
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=LAYERS, init_from=str(old))
  lines = []
  got = trainer._init_from_pretraining(Transformer(model_cfg, rngs=nnx.Rngs(1)), cfg,
                                       lines.append)
  for x, y in zip(_params(got), _params(saved)):
    np.testing.assert_array_equal(x, y)
  assert any(f"{old}/stage_b/checkpoints holds no checkpoint yet (passed over)" in l
             for l in lines), lines
  assert "init_from: the weights of pretraining stage 'stage_a' step 7 (final)" in lines[-1]
  # an RL workdir (initialised from a pretraining run: no tokenizer.json of its own)
  tok = trainer._tokenizer(PRESETS["tiny"], tmp_path / "t", 512)
  rl = tmp_path / "rl_done"
  _save(rl / "sft" / "checkpoints", state.replace(step=jnp.asarray(4, jnp.int32)),
        {"phase": "sft", "model": ckpt_lib.to_json(model_cfg),
         "tokenizer": {"fingerprint": tok.fingerprint, "json": tok.to_json()}})
  cfg = dataclasses.replace(cfg, init_from=str(rl))
  assert trainer._tokenizer(cfg, tmp_path / "x", 512).to_json() == tok.to_json()
  lines = []
  trainer._init_from_pretraining(Transformer(model_cfg, rngs=nnx.Rngs(1)), cfg, lines.append)
  assert lines == [f"init_from: the weights of RL phase 'sft' step 4 (final) in "
                   f"{rl}/sft/checkpoints"], lines


def test_a_changed_config_is_refused_before_any_eval(tmp_path, monkeypatch):
  """A finished workdir rerun with `--set grpo.kl_coef=0.01` was refused only when the GRPO
  phase restored, after SFT had been restored and its held-out eval (256 episodes) rerun and
  sft/eval.json rewritten; the phases' saved configs are now compared before anything is
  built, compiled or evaluated."""
  _no_training(monkeypatch)
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=LAYERS)
  wd = tmp_path / "rl"
  tok = trainer._tokenizer(cfg, wd, 512)
  fit = trainer.fit_lengths(cfg, tok)
  for phase, step in (("sft", cfg.sft_steps), ("grpo", cfg.grpo_steps)):
    _save(wd / phase / "checkpoints", _tiny_state(step),
          {"phase": phase, "rl": ckpt_lib.to_json(fit)})
  changed = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, kl_coef=0.01))
  with pytest.raises(ckpt_lib.ConfigMismatchError,
                     match=r"\[grpo\].*grpo.kl_coef: 0.0 \(saved\) vs 0.01 \(now\)"):
    trainer.run(changed, str(wd))
  with pytest.raises(ckpt_lib.ConfigMismatchError, match=r"\[grpo\].*grpo_steps: 40 \(saved\)"):
    trainer.run(dataclasses.replace(cfg, grpo_steps=8), str(wd))
  with pytest.raises(ckpt_lib.ConfigMismatchError, match=r"\[sft\].*sft_batch: 64 \(saved\)"):
    trainer.run(dataclasses.replace(cfg, sft_batch=8), str(wd))
  assert not (wd / "sft" / "eval.json").exists()
  trainer.check_saved_phases(fit, wd)  # the same settings resume


def test_a_resumed_phase_says_where_it_resumes(tmp_path):
  """The RL phases resumed silently (the pretraining loop says "resuming from step N")."""
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=LAYERS)
  model_cfg = get_preset("tiny", **dict(LAYERS))
  phase = trainer._Phase(cfg, tmp_path, "sft", Transformer(model_cfg, rngs=nnx.Rngs(0)),
                         cfg.sft_optim, 4, False)
  phase.ckpt.save(phase.state.replace(step=jnp.asarray(2, jnp.int32)), data_state=None,
                  meta=phase.meta)
  phase.close()
  lines = []
  phase = trainer._Phase(cfg, tmp_path, "sft", Transformer(model_cfg, rngs=nnx.Rngs(1)),
                         cfg.sft_optim, 4, False, log=lines.append)
  phase.close()
  assert lines == [f"[sft] resuming from step 2 of 4 ({tmp_path}/sft/checkpoints)"], lines


def test_optimizer_errors_name_the_phases_key():
  """`--set grpo_optim.name=sgdd` suggested `--set optim.name=muon`, not a key of this CLI."""
  cfg = PRESETS["tiny"]
  for name in ("grpo_optim", "sft_optim"):
    bad = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name),
                                                                name="sgdd")})
    with pytest.raises(ValueError) as e:
      bad.validate()
    msg = str(e.value)
    assert f"{name}.name='sgdd'" in msg and f"--set {name}.name=muon" in msg, msg
    assert " optim." not in msg, msg


def test_a_grpo_phase_preempted_at_an_eval_step_keeps_that_eval(tmp_path):
  """A SIGTERM during an eval step saved that step and stopped before its held-out eval; the
  resumed phase started after it, so eval_curve.jsonl lacked the point for good. The stop stays
  prompt (the eval is not run then); the resumed phase runs it first, on the restored weights."""
  from sparse_lm.inference import Engine
  layers = LAYERS + (("residual", "standard"), ("num_dense_layers", 2))  # fastest to compile
  cfg = dataclasses.replace(
      PRESETS["tiny"], model_overrides=layers, grpo_steps=2, prompts_per_step=2, eval_every=1,
      eval_tasks=2, grpo=dataclasses.replace(PRESETS["tiny"].grpo, group_size=2))
  model_cfg = get_preset("tiny", **dict(layers))
  tok = trainer._tokenizer(cfg, tmp_path, model_cfg.vocab_size)
  cfg = trainer.fit_lengths(cfg, tok)
  model = Transformer(model_cfg, rngs=nnx.Rngs(0))
  engine = Engine(model, max_length=cfg.seq_len, max_batch=4)
  signal = loop.Preemption(multiprocess=False)  # as if a SIGTERM had arrived during step 1
  signal.requested = "SIGTERM"
  lines = []
  with pytest.raises(trainer.Preempted, match=r"\[grpo\] SIGTERM: saved step 1"):
    trainer.run_grpo(cfg, tmp_path, model, tok, engine, log=lines.append, preemption=signal)
  curve = tmp_path / "grpo" / "eval_curve.jsonl"
  assert not any("held-out" in l for l in lines)  # stopped at once, before the eval
  lines = []
  _, history = trainer.run_grpo(cfg, tmp_path, Transformer(model_cfg, rngs=nnx.Rngs(1)), tok,
                                engine, log=lines.append)
  assert len(history) == 1
  assert curve.exists() and [json.loads(l)["step"] for l in curve.read_text().splitlines()] == [1]
  assert lines[0].startswith("[grpo] resuming from step 1 of 2"), lines
  assert lines[1].startswith("held-out after grpo step 1: "), lines  # before step 2
  assert lines[2].startswith("grpo 2/2"), lines
  # a finished phase rerun neither repeats nor adds a point
  trainer.run_grpo(cfg, tmp_path, Transformer(model_cfg, rngs=nnx.Rngs(1)), tok, engine)
  assert [json.loads(l)["step"] for l in curve.read_text().splitlines()] == [1]


def test_a_signal_during_the_eval_after_sft_stops_before_grpo(tmp_path, monkeypatch):
  """A SIGTERM during the held-out eval after SFT used to be acted on only after GRPO was
  built, compiled, rolled out and had taken a step; the run now stops once that eval is
  written, with Preempted naming it."""
  import os
  import signal
  from sparse_lm.inference import engine as engine_lib
  def sft(cfg, wd, model, tok, **k):  # a finished SFT phase, without its training
    (wd / "sft").mkdir()
    return model
  monkeypatch.setattr(trainer, "run_sft", sft)
  monkeypatch.setattr(engine_lib.Engine, "__init__", lambda self, *a, **k: None)

  def evaluate(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)  # the run's handler records it
    return {"success": 0.5}

  def grpo(*a, **k):
    raise AssertionError("GRPO started after the signal")
  monkeypatch.setattr(trainer, "evaluate", evaluate)
  monkeypatch.setattr(trainer, "run_grpo", grpo)
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=(("num_layers", 3),
                                                              ("mla_every", 2)))
  with pytest.raises(trainer.Preempted, match=r"\[sft\] SIGTERM during the held-out eval after "
                     r"sft: sft is saved and its eval written to .*eval.json; run the same "
                     "command again"):
    trainer.run(cfg, str(tmp_path), log=lambda *a: None)
  assert (tmp_path / "sft" / "eval.json").exists()


def test_a_warmup_longer_than_the_phase_is_warned_about(tmp_path, monkeypatch):
  """`--set sft_optim.warmup_steps=500 --set sft_steps=10` ran silently with a peak learning
  rate never reached; the run now says so before SFT."""
  lines = []

  def stop(*a, **k):
    raise KeyboardInterrupt  # the check is before SFT: stop there
  monkeypatch.setattr(trainer, "run_sft", stop)
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=(("num_layers", 3),
                                                              ("mla_every", 2)), sft_steps=10,
                            sft_optim=dataclasses.replace(PRESETS["tiny"].sft_optim,
                                                          warmup_steps=500))
  with pytest.raises(KeyboardInterrupt):
    trainer.run(cfg, str(tmp_path), log=lines.append)
  assert any("warning: sft_optim.warmup_steps=500 > sft_steps=10: the sft learning rate never "
             "reaches its peak" in x for x in lines), lines
  assert not any("grpo_optim.warmup_steps" in x for x in lines)
