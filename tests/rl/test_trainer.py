"""The RL trainer: config errors name the field; an interrupted SFT phase resumes exactly; a
phase does not resume under another config."""

import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.agentic_rl import PRESETS, apply_sets
from sparse_lm.config import get_preset
from sparse_lm.model.transformer import Transformer
from sparse_lm.rl import trainer
from sparse_lm.train import checkpoint as ckpt_lib
from sparse_lm.train import loop


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
  assert not any((tmp_path / "rl").glob("*"))  # the CLI may create it; nothing is written
  # a stage that has saved no step is not one to start from (tests/rl/test_trainer_guards.py)
  (tmp_path / "stage_8k" / "checkpoints").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match="stage_8k/checkpoints holds no checkpoint yet"):
    trainer.pretraining_stages(str(tmp_path))
  (tmp_path / "stage_8k" / "checkpoints" / "100").mkdir()
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


def _phase_checkpoints_load_on_their_own(workdir, model, tok):
  """An RL phase's checkpoint records its model config and tokenizer: `python -m
  sparse_lm.generate --workdir W` (load_workdir) and `--checkpoint` (load_checkpoint) load
  its weights (both failed with KeyError 'stage', the first as "no readable checkpoint ...
  move the checkpoints aside"); `sparse_lm.train.load` says these are not a stage's."""
  from sparse_lm import generate
  from sparse_lm.train import load
  from sparse_lm.train.trained import NotAStageError
  want = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
  loaded, tokenizer, where = generate.load_workdir(workdir)
  assert where.startswith("sft (RL phase), preset tiny") and \
      tokenizer.to_json() == tok.to_json()
  got, _, meta = generate.load_checkpoint(workdir / "sft" / "checkpoints" / "4", preset="tiny")
  for m in (loaded, got):
    assert m.cfg == model.cfg
    for x, y in zip(want, jax.tree.leaves(nnx.state(m, nnx.Param))):
      np.testing.assert_array_equal(x, np.asarray(y))
  assert meta["phase"] == "sft"
  with pytest.raises(ValueError, match=r"preset='small'.*holds a 'tiny' model"):
    generate.load_checkpoint(workdir / "sft" / "checkpoints" / "4", preset="small")
  with pytest.raises(NotAStageError, match=r"an RL phase's \('sft'\).*--stage sft") as err:
    load(workdir)
  assert err.value.stage_dir == workdir.absolute() / "sft" and err.value.meta["phase"] == "sft"
  # a checkpoint written before the phases recorded model config and tokenizer: refused by name
  old = workdir.parent / f"{workdir.name}_old"
  shutil.copytree(workdir / "sft", old / "sft")
  for f in (old / "sft" / "checkpoints").glob("*/meta/metadata"):
    m = json.loads(f.read_text())
    f.write_text(json.dumps({k: v for k, v in m.items() if k not in ("model", "tokenizer")}))
  for fn in (lambda: generate.load_workdir(old),
             lambda: generate.load_checkpoint(old / "sft" / "checkpoints" / "4")):
    with pytest.raises(ValueError, match="records no model config and tokenizer"):
      fn()


def test_sft_resumes_exactly(tmp_path):
  # 3 layers (KDA, MLA, MLA; two MoE): what is checked is the resume, not the depth.
  layers = (("num_layers", 3), ("mla_every", 2))
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=layers, sft_steps=4,
                            sft_batch=4, checkpoint_every=2, seq_len=48)
  model_cfg = get_preset("tiny", **dict(layers))
  tok = trainer._tokenizer(cfg, tmp_path / "a", model_cfg.vocab_size)
  full = trainer.run_sft(cfg, tmp_path / "a", Transformer(model_cfg, rngs=nnx.Rngs(0)), tok)
  _phase_checkpoints_load_on_their_own(tmp_path / "a", full, tok)
  # an interrupted run: only the step-2 checkpoint exists; it resumes from there
  shutil.copytree(tmp_path / "a" / "sft" / "checkpoints" / "2",
                  tmp_path / "b" / "sft" / "checkpoints" / "2")
  resumed = trainer.run_sft(cfg, tmp_path / "b", Transformer(model_cfg, rngs=nnx.Rngs(1)), tok)
  for x, y in zip(jax.tree.leaves(nnx.state(full, nnx.Param)),
                  jax.tree.leaves(nnx.state(resumed, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # a SIGTERM during step 1 (between checkpoints): the phase saves step 1 and stops (it used
  # to die unsaved, losing the steps since the last checkpoint); the rerun ends where `full` did
  signal = loop.Preemption(multiprocess=False)  # as if a SIGTERM had arrived
  signal.requested = "SIGTERM"
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


def test_a_non_finite_step_stops_the_phase_keeping_its_last_good_checkpoint(tmp_path,
                                                                           monkeypatch):
  """A step whose loss is NaN (fault injection at step 2) stops SFT with NonFiniteLossError
  naming the step and the last good checkpoint, which stays. (The step function keeps the old
  state at such a step; the phase used to go on silently with its step count behind the
  loop's, and end without its final checkpoint: "4" was never written.)"""
  from sparse_lm.model.loss import loss_fn
  from sparse_lm.moe.balancing import update_balancers
  from sparse_lm.rl import grpo
  from sparse_lm.train.step import make_train_step

  monkeypatch.setattr(grpo, "make_sft_step", lambda graphdef, tx, schedule: make_train_step(
      graphdef, tx, schedule, loss_fn, balance_fn=update_balancers, nan_at_step=2))
  layers = (("num_layers", 3), ("mla_every", 2))
  cfg = dataclasses.replace(PRESETS["tiny"], model_overrides=layers, sft_steps=4,
                            sft_batch=2, checkpoint_every=2, seq_len=48)
  model_cfg = get_preset("tiny", **dict(layers))
  tok = trainer._tokenizer(cfg, tmp_path, model_cfg.vocab_size)
  ckpts = tmp_path / "sft" / "checkpoints"
  with pytest.raises(loop.NonFiniteLossError, match=(
      r"\[sft\] non-finite loss \(nan\) or gradient norm .* at step 2 \(0-based.*the update "
      r"was not applied; the last good checkpoint is step 2 in " + re.escape(str(ckpts)))):
    trainer.run_sft(cfg, tmp_path, Transformer(model_cfg, rngs=nnx.Rngs(0)), tok)
  assert sorted(p.name for p in ckpts.iterdir() if p.name.isdigit()) == ["2"]


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


def test_grpo_settings_are_validated_naming_the_field_and_range(tmp_path, capsys):
  """`--set grpo.clip_low=-1` was accepted (a clip range above 1 on both sides); every GRPO
  setting with an obvious range is now refused before anything compiles."""
  cfg = PRESETS["tiny"]
  for field, value, want in (
      ("clip_low", -1.0, r"grpo.clip_low=-1.0 must be a finite number in \[0, 1\]"),
      ("clip_low", 1.5, r"grpo.clip_low=1.5 must be a finite number in \[0, 1\]"),
      ("clip_high", -0.2, r"grpo.clip_high=-0.2 must be a finite number >= 0"),
      ("kl_coef", -0.05, r"grpo.kl_coef=-0.05 must be a finite number >= 0"),
      ("kl_coef", float("nan"), r"grpo.kl_coef=nan must be"),
      ("eps", 0.0, r"grpo.eps=0.0 must be a finite number > 0"),
      ("temperature", 0.0, r"grpo.temperature=0.0 must be a finite number > 0"),
      ("temperature", float("inf"), r"grpo.temperature=inf must be a finite number"),
      ("group_size", 1, r"grpo.group_size=1 must be an integer >= 2"),
      ("group_size", 2.5, r"grpo.group_size=2.5 must be an integer >= 2"),
      ("scale_by_std", "yes", r"grpo.scale_by_std='yes' must be true or false")):
    with pytest.raises(ValueError, match=want):
      dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, **{field: value})).validate()
  for field, value, want in (("partial_credit", "x", "partial_credit='x' must be in"),
                             ("sft_seq_len", "32", "sft_seq_len='32' must be an integer > 0")):
    with pytest.raises(ValueError, match=want):
      dataclasses.replace(cfg, **{field: value}).validate()
  dataclasses.replace(cfg, grpo=dataclasses.replace(  # the edges of the ranges are valid
      cfg.grpo, clip_low=0.0, clip_high=0.0, kl_coef=0.0, group_size=2)).validate()
  # the CLI refuses it before the workdir, the tokenizer or a compile
  from experiments import agentic_rl
  with pytest.raises(SystemExit) as e:
    agentic_rl.main(["--preset=tiny", f"--workdir={tmp_path}/rl", "--set", "grpo.clip_low=-1"])
  assert e.value.code == 2
  assert "grpo.clip_low=-1.0 must be a finite number in [0, 1]" in capsys.readouterr().err
  assert not (tmp_path / "rl").exists()


def test_set_env_drops_the_presets_env_settings_as_env_does(tmp_path, capsys):
  """`--preset small --set env=lookup` kept the passkey env's doc_chars (LookupEnv got an
  unexpected keyword argument 'doc_chars'); it now does what `--env lookup` does, and a
  `--set env_overrides` given with either applies to the new env."""
  small = PRESETS["small"]
  assert small.env_overrides  # the passkey env's doc_chars
  out = apply_sets(small, ["env=lookup"])
  assert (out.env, out.env_overrides) == ("lookup", ())
  out.validate()
  out = apply_sets(small, ['env_overrides=[["num_keys", 8]]', "env=lookup"])
  assert (out.env, out.env_overrides) == ("lookup", (("num_keys", 8),))
  assert out.env_instance().num_keys == 8
  assert apply_sets(small, ["env=passkey"]).env_overrides == small.env_overrides  # same env
  from experiments import agentic_rl
  for args in (["--set", "env=lookup"], ["--env=lookup"],
               ["--env=lookup", "--set", 'env_overrides=[["num_keys", 8]]']):
    with pytest.raises(SystemExit) as e:  # validation reaches the model config, past the env
      agentic_rl.main(["--preset=small", f"--workdir={tmp_path}/rl", *args, "--set",
                       'model_overrides=[["not_a_field", 1]]'])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not_a_field" in err and "doc_chars" not in err, err


def test_tuple_fields_name_the_key_and_the_form():
  """`--set model_overrides=num_layers` (not JSON) said "dictionary update sequence element #0
  has length 1"; a tuple field now takes a JSON list of [name, value] pairs (or an object)
  and names the key and that form otherwise."""
  cfg = PRESETS["tiny"]
  for text in ("num_layers", "[1, 2]", '[["num_layers"]]', '[[3, "num_layers"]]', "3"):
    with pytest.raises(ValueError, match=r"--set model_overrides=.* must be a JSON list of "
                       r"\[name, value\] pairs"):
      apply_sets(cfg, [f"model_overrides={text}"])
  with pytest.raises(ValueError, match=r"--set env_overrides='num_keys=8' must be a JSON list"):
    apply_sets(cfg, ["env_overrides=num_keys=8"])
  for text in ('[["num_layers", 3], ["mla_every", 2]]', '{"num_layers": 3, "mla_every": 2}'):
    out = apply_sets(cfg, [f"model_overrides={text}"])
    assert out.model_overrides == (("num_layers", 3), ("mla_every", 2))
    out.validate()


def test_sft_phase_resumes_under_other_grpo_settings():
  """One SFT checkpoint serves GRPO runs with other GRPO settings (a finished workdir rerun
  with `--set grpo_steps=3` stopped with "[sft] ... grpo_steps: 2 (saved) vs 3 (now)"); the
  GRPO phase and SFT's own settings are still checked. The end-to-end resume is in
  test_grpo_resume.py."""
  cfg = PRESETS["tiny"]  # sft_seq_len set: seq_len is GRPO's alone
  meta = {"step": 125, "rl": ckpt_lib.to_json(cfg)}
  grpo_only = dataclasses.replace(
      cfg, grpo_steps=3, prompts_per_step=4, partial_credit=0.0, max_turn_tokens=16,
      seq_len=96, grpo=dataclasses.replace(cfg.grpo, kl_coef=0.05, clip_high=0.28),
      grpo_optim=dataclasses.replace(cfg.grpo_optim, peak_lr=1e-4))
  trainer.check_resume(meta, grpo_only, "sft")
  with pytest.raises(ckpt_lib.ConfigMismatchError) as e:
    trainer.check_resume(meta, grpo_only, "grpo")
  assert "[grpo]" in str(e.value) and "grpo_steps: 40 (saved) vs 3 (now)" in str(e.value)
  assert "move <workdir>/grpo aside" in str(e.value)
  for change, want in ((dict(sft_batch=8), "sft_batch: 64 (saved) vs 8 (now)"),
                       (dict(seed=1), "seed: 0 (saved) vs 1 (now)"),
                       (dict(sft_seq_len=48), "sft_seq_len: 32 (saved) vs 48 (now)"),
                       (dict(sft_optim=dataclasses.replace(cfg.sft_optim, peak_lr=1e-3)),
                        "sft_optim.peak_lr")):
    with pytest.raises(ckpt_lib.ConfigMismatchError, match=re.escape(want)):
      trainer.check_resume(meta, dataclasses.replace(grpo_only, **change), "sft")
  # without sft_seq_len, seq_len is SFT's length too
  no_sft_len = dataclasses.replace(cfg, sft_seq_len=None)
  meta = {"step": 125, "rl": ckpt_lib.to_json(no_sft_len)}
  with pytest.raises(ckpt_lib.ConfigMismatchError, match=r"seq_len: 64 \(saved\) vs 96"):
    trainer.check_resume(meta, dataclasses.replace(no_sft_len, seq_len=96), "sft")
