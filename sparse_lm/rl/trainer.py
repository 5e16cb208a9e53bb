"""`run(cfg, workdir)`: SFT warm-up on tool-use transcripts, then GRPO on the engine's rollouts.

Two phases, each a stage directory with its own Orbax checkpoints (`train.checkpoint`):
  <workdir>/sft    next-token loss on the model-written tokens of reference transcripts
                   (rollout.transcript: the tools really run; results masked out);
  <workdir>/grpo   starts from sft's final weights; each step samples `prompts_per_step` tasks,
                   `group_size` episodes each through the inference engine (temperature
                   `grpo.temperature`), scores them, and takes one GRPO step (grpo.py).
Held-out success (greedy, `eval_tasks` tasks from a seed stream the training never draws from)
is measured after SFT and after GRPO and written to `<workdir>/<phase>/eval.json` (and every
`eval_every` GRPO steps to `<workdir>/grpo/eval_curve.jsonl`).

Everything random is a function of (cfg.seed, phase, step): a resumed run restores the state of
its newest checkpoint and redraws exactly the tasks and samples it would have drawn (exact
resume). TensorBoard events and `metrics.jsonl` go to `<workdir>/<phase>/tb`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_lm.config import get_preset
from sparse_lm.rl import envs as envs_lib
from sparse_lm.rl import grpo, rollout
from sparse_lm.train.checkpoint import (Checkpointer, ConfigMismatchError, check_model,
                                       differences, listing, to_json)
from sparse_lm.train.loop import NonFiniteLossError, Preemption
from sparse_lm.train.metrics import MetricsWriter, drop_lines_after
from sparse_lm.train.optimizer import OptimizerConfig, make_optimizer, wsd_schedule
from sparse_lm.train.state import TrainState, split_model
from sparse_lm.train.trained import _stage_dirs as stage_dirs_with_checkpoints
from sparse_lm.train.workdir import WorkdirLock, local_workdir

EVAL_SEED_OFFSET = 1_000_003  # the held-out task stream
# RLConfig fields a resumed phase may change: what is evaluated and how often it is saved.
RESUMABLE_CHANGES = ("eval_tasks", "eval_every", "checkpoint_every")
# RLConfig fields the SFT phase never reads (only GRPO's rollouts, rewards and steps do), so one
# SFT checkpoint serves GRPO runs under other settings. seq_len too when sft_seq_len is set.
GRPO_ONLY = ("grpo_steps", "prompts_per_step", "grpo", "grpo_optim", "partial_credit",
             "max_turn_tokens")
PHASES = ("sft", "grpo")  # the stage directories of an RL workdir


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """An agentic-RL run. Sizes in tokens (seq_len: longest episode; sft_seq_len: the length SFT
  transcripts are padded to, None = seq_len), steps, episodes. partial_credit: GRPO's reward
  for a wrong final answer after a tool returned the right one (grpo.episode_rewards)."""

  preset: str = "tiny"
  model_overrides: tuple[tuple[str, Any], ...] = ()
  env: str = "arithmetic"
  env_overrides: tuple[tuple[str, Any], ...] = ()
  seed: int = 0
  seq_len: int = 96
  max_turn_tokens: int = 24
  sft_seq_len: int | None = None
  sft_steps: int = 150
  sft_batch: int = 32
  sft_optim: OptimizerConfig = OptimizerConfig(peak_lr=3e-3, warmup_steps=20, weight_decay=0.0)
  grpo_steps: int = 30
  prompts_per_step: int = 8
  grpo: grpo.GRPOConfig = grpo.GRPOConfig(group_size=8)
  grpo_optim: OptimizerConfig = OptimizerConfig(peak_lr=3e-4, warmup_steps=0,
                                                decay_fraction=0.0, weight_decay=0.0)
  partial_credit: float = 0.0
  eval_tasks: int = 256
  eval_every: int = 0
  checkpoint_every: int = 25
  init_from: str | None = None

  def env_instance(self):
    if self.env not in envs_lib.ENVS:
      raise ValueError(f"RLConfig.env={self.env!r}; choose one of {sorted(envs_lib.ENVS)}")
    return envs_lib.make_env(self.env, **dict(self.env_overrides))

  def validate(self) -> None:
    """Raise ValueError naming the offending field."""
    for f in ("seq_len", "max_turn_tokens", "sft_batch", "prompts_per_step", "eval_tasks",
              "checkpoint_every"):
      if not _is_int(getattr(self, f)) or getattr(self, f) <= 0:
        raise ValueError(f"RLConfig: {f}={getattr(self, f)!r} must be an integer > 0")
    for f in ("sft_steps", "grpo_steps", "eval_every", "seed"):
      value = getattr(self, f)
      if not _is_int(value) or value < 0:
        raise ValueError(f"RLConfig: {f}={value!r} must be an integer >= 0"
                         + (" (0: evaluate only at the phases' ends)" if f == "eval_every"
                            else ""))
    if self.sft_seq_len is not None and (not _is_int(self.sft_seq_len)
                                         or self.sft_seq_len <= 0):
      raise ValueError(f"RLConfig: sft_seq_len={self.sft_seq_len!r} must be an integer > 0 "
                       "(or None: seq_len)")
    if not _is_number(self.partial_credit) or not 0.0 <= self.partial_credit < 1.0:
      raise ValueError(f"RLConfig: partial_credit={self.partial_credit!r} must be in [0, 1) (a "
                       "success earns 1)")
    self._validate_grpo()
    for name in ("sft_optim", "grpo_optim"):  # before SFT runs, not when GRPO starts
      try:
        getattr(self, name).validate()
      except (ValueError, TypeError) as e:  # every "optim.x" (the --set hint's too) is name's
        raise ValueError("RLConfig: " + _OPTIM_KEY.sub(name + ".", str(e))) from None
    self.env_instance()
    get_preset(self.preset, **dict(self.model_overrides))

  def _validate_grpo(self) -> None:
    """Raise ValueError naming the `grpo.` field and its valid range (grpo.py's loss)."""
    g = self.grpo
    if not _is_int(g.group_size) or g.group_size < 2:
      raise ValueError(f"RLConfig: grpo.group_size={g.group_size!r} must be an integer >= 2 "
                       "(the advantage is relative to the group)")
    if not isinstance(g.scale_by_std, bool):
      raise ValueError(f"RLConfig: grpo.scale_by_std={g.scale_by_std!r} must be true or false")
    # field: (test on a finite number, what it must be); `not test` also refuses NaN
    ranges = {
        "clip_low": (lambda x: 0 <= x <= 1, "in [0, 1] (the ratio is clipped below at "
                     "1 - clip_low; DAPO uses 0.2)"),
        "clip_high": (lambda x: x >= 0, ">= 0 (the ratio is clipped above at 1 + clip_high; "
                      "DAPO uses 0.28)"),
        "kl_coef": (lambda x: x >= 0, ">= 0 (0: no KL term, no reference policy)"),
        "eps": (lambda x: x > 0, "> 0 (a group of equal rewards gets advantage 0, not 0/0)"),
        "temperature": (lambda x: x > 0, "> 0 (the sampling policy is softmax(logits / T))"),
    }
    for name, (test, want) in ranges.items():
      value = getattr(g, name)
      if not _is_number(value) or not math.isfinite(value) or not test(value):
        raise ValueError(f"RLConfig: grpo.{name}={value!r} must be a finite number {want}")


_OPTIM_KEY = re.compile(r"(?<![\w.])optim[.]")  # OptimizerConfig's messages name "optim.<field>"


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def fit_lengths(cfg: RLConfig, tok, log=print, *, samples: int = 256) -> RLConfig:
  """`cfg` with `max_turn_tokens`, `seq_len` and `sft_seq_len` raised to what the env's
  episodes need with `tok`.

  How many tokens a task takes depends on the tokenizer (the preset's own, or a pretraining
  run's with `init_from`) and the env, so a preset's lengths, sized for one pair, can be too
  short for another: an SFT transcript longer than `sft_seq_len` stopped the run; a model turn
  longer than `max_turn_tokens` is cut off, so its call never closes (the code env's calls,
  25-32 tokens, against the tiny preset's 24: no episode could succeed); and a turn is only
  started with `max_turn_tokens` of room left in `seq_len` (rollout.run_episodes), so a prompt
  or a final answer starting too late got no turn at all (success 0, silently). Over `samples`
  tasks (a fixed draw, so a resumed run gets the same lengths), with the reference transcripts
  (rollout.transcript): the longest transcript L, the longest model turn M (its stop token
  included) and the latest start S of a model turn; `max_turn_tokens` becomes at least M,
  `sft_seq_len` (if set) at least L and `seq_len` at least max(L, S + max_turn_tokens), each
  rounded up to a multiple of 16, and the changes are logged in one line. As for the other
  lengths, a value given explicitly is raised too: one below what the reference needs cannot
  run the env.

  Raises:
    ValueError: an unknown `cfg.env` (RLConfig.env_instance).
  """
  env = cfg.env_instance()
  rng = np.random.default_rng([cfg.seed, 5])
  longest = prompt = turn = start = 0
  for _ in range(samples):
    task = env.sample(rng)
    ids, gen = rollout.transcript(tok, task)
    longest = max(longest, len(ids))
    prompt = max(prompt, len(rollout.prompt_ids(tok, task)))
    for first, length in _turns(gen):
      turn, start = max(turn, length), max(start, first)
  up = lambda n: -(-n // 16) * 16
  changes = {}
  if cfg.max_turn_tokens < turn:
    changes["max_turn_tokens"] = up(turn)
  max_turn = changes.get("max_turn_tokens", cfg.max_turn_tokens)
  if cfg.sft_seq_len is not None and cfg.sft_seq_len < longest:
    changes["sft_seq_len"] = up(longest)
  need = max(longest, prompt + max_turn, start + max_turn)
  if cfg.seq_len < need:
    changes["seq_len"] = up(need)
  if changes:
    log(f"{cfg.env} episodes with this tokenizer: SFT transcripts up to {longest} tokens, "
        f"model turns up to {turn}, prompts up to {prompt}, the last turn starting at up to "
        f"token {start} (+ max_turn_tokens {max_turn}); using "
        + ", ".join(f"{k}={v} (was {getattr(cfg, k)})" for k, v in changes.items()))
  return dataclasses.replace(cfg, **changes)


def _turns(generated) -> list[tuple[int, int]]:
  """(start, length) of each run of model-written tokens (a model turn) in a transcript's
  mask; observations separate the turns."""
  out, first = [], None
  for i, g in enumerate(list(generated) + [False]):
    if g and first is None:
      first = i
    elif not g and first is not None:
      out.append((first, i - first))
      first = None
  return out


def _rng(cfg: RLConfig, phase: str, step: int) -> np.random.Generator:
  return np.random.default_rng([cfg.seed, {"sft": 1, "grpo": 2, "tok": 3, "eval": 4}[phase],
                                step])


def _tokenizer(cfg: RLConfig, workdir: pathlib.Path, vocab: int, log=print):
  """The init_from run's tokenizer (its tokenizer.json, else the one its newest checkpoint
  records: an RL workdir that was itself initialised from a pretraining run has no
  tokenizer.json), else one cached in workdir, else a BPE trained on this environment's
  transcripts (seconds; the code env runs each reference program in its sandbox: minutes)."""
  from sparse_lm.data.tokenizer import Tokenizer, train_bpe  # pylint: disable=import-outside-toplevel
  if cfg.init_from:
    path = pathlib.Path(cfg.init_from) / "tokenizer.json"
    if path.exists():
      return Tokenizer.load(str(path))
    ckpt = Checkpointer(pretraining_stages(cfg.init_from)[-1], async_save=False)
    try:
      recorded = ckpt.read_meta(ckpt.all_steps()[-1]).get("tokenizer") or {}
    finally:
      ckpt.close()
    if not recorded.get("json"):
      raise FileNotFoundError(
          f"init_from={cfg.init_from!r} has no tokenizer.json and its newest checkpoint "
          f"({ckpt.directory}) records no tokenizer: give the workdir of the run that trained "
          "it (the one holding tokenizer.json)")
    return Tokenizer.from_json(recorded["json"])
  path = workdir / "tokenizer.json"
  if path.exists():
    return Tokenizer.load(str(path))
  env, rng = cfg.env_instance(), _rng(cfg, "tok", 0)
  slow = " (the code env runs each in its sandbox: minutes)" if cfg.env == "code" else ""
  log(f"training a {vocab}-id BPE tokenizer on 2,000 solved {cfg.env} tasks{slow}; cached in "
      f"{path}")
  texts = []
  for _ in range(2000):
    task = env.sample(rng)
    calls, answer = task.solution
    from sparse_lm.rl.format import format_call  # pylint: disable=import-outside-toplevel
    texts.append(task.prompt + "\n" + "".join(
        format_call(c.name, c.arguments) + task.tools.call(c).output for c in calls) + answer)
  tok = train_bpe(iter(texts), vocab)
  workdir.mkdir(parents=True, exist_ok=True)
  tok.save(str(path))
  return tok


def _fresh_state(model, optim: OptimizerConfig, steps: int, seed: int):
  graphdef, params, rest = split_model(model)
  tx = make_optimizer(optim, steps)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, model_vars=rest,
                     opt_state=tx.init(params), rng=jax.random.PRNGKey(seed))
  return graphdef, tx, state


def _restore(ckpt: Checkpointer, state: TrainState, check_meta=None, *, set_aside=True):
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                         sharding=a.sharding), state)
  return ckpt.restore_latest(abstract, check_meta, set_aside=set_aside)


def check_resume(meta: dict, cfg: RLConfig, phase: str) -> None:
  """Refuse to resume a phase whose checkpoint was written under another RLConfig.

  `meta["rl"]` is the config the checkpoint was saved with (`to_json`; checkpoints of older
  runs have none and are not checked). Fields outside RESUMABLE_CHANGES change what the
  resumed steps draw or optimise (env, seed, lengths, batch, optimiser, GRPO settings, the
  model), so a run that continued under them would be neither the old run nor a new one. The
  "sft" phase also ignores the fields it never reads (GRPO_ONLY, and seq_len when sft_seq_len
  is set): its checkpoints serve GRPO runs under other GRPO settings.

  Raises:
    ConfigMismatchError: the configs differ outside the fields `phase` may change (the
      message lists "field: saved vs now" and the ways on).
  """
  saved = meta.get("rl")
  if not saved:
    return
  ignored = RESUMABLE_CHANGES
  if phase == "sft":
    ignored += GRPO_ONLY + (("seq_len",) if cfg.sft_seq_len is not None else ())
  diff = {k: v for k, v in differences(saved, to_json(cfg)).items()
          if k.split(".")[0] not in ignored}
  if diff:
    hint = (" (or move <workdir>/grpo aside to run GRPO anew from the saved SFT phase)"
            if phase == "grpo" else "")
    raise ConfigMismatchError(
        f"[{phase}] the checkpoint at step {meta.get('step')} was written with another RL "
        f"config: {listing(diff)}. Run with the saved settings to resume, or use a new "
        f"--workdir{hint}.")


class NotAnRLWorkdirError(ConfigMismatchError):
  """The RL run's workdir holds another run's checkpoints (a pretraining stage's): the RL
  phases would be written beside them, from random weights. A ConfigMismatchError (a
  ValueError): the CLI prints the message and exits 2, as for a workdir of other settings."""


def check_rl_workdir(workdir: str | pathlib.Path) -> None:
  """Refuse a workdir that holds `<name>/checkpoints` other than the RL phases' (sft, grpo).

  Such a directory is a pretraining stage's (`python -m experiments.stage_8k --workdir W`), or
  another run's: an RL run there started from random weights, reused that run's
  tokenizer.json and wrote sft/ and grpo/ beside the stages, after which
  `sparse_lm.train.load(W)` failed (the newest checkpoints were an RL phase's).

  Raises:
    NotAnRLWorkdirError: naming the directory found and the way on (`--init_from W` with a
      fresh `--workdir`).
  """
  workdir = pathlib.Path(workdir)
  others = sorted(d.parent for d in workdir.glob("*/checkpoints")
                  if d.is_dir() and d.parent.name not in PHASES)
  if others:
    saved = [d for d in stage_dirs_with_checkpoints(workdir) if d.name not in PHASES]
    found = ", ".join(f"{d}/checkpoints" for d in others)
    raise NotAnRLWorkdirError(
        f"--workdir {workdir} holds {found}: the checkpoints of a pretraining stage (or of "
        "another run), not of an RL run (whose workdir holds only sft/ and grpo/). An RL run "
        "there would start from random weights and write its phases beside that run's. "
        + (f"To start RL from that run's weights, give --init_from {workdir} and a fresh "
           f"--workdir (e.g. --workdir {workdir}_rl)." if saved else
           f"{found} holds no saved step yet; give a fresh --workdir (and --init_from "
           f"{workdir} once it has saved one)."))


def pretraining_stages(init_from: str, log=None) -> list[pathlib.Path]:
  """The `<stage>/checkpoints` directories of the workdir `init_from` that hold a saved step,
  oldest first (by their newest step's modification time; `sparse_lm.train.load`'s order):
  the RL run starts from the newest. A pretraining workdir's stages, or an RL workdir's phases
  (sft, grpo: a new RL run from a finished one's policy). A newer `<stage>/checkpoints` with
  no step yet (a run stopped before its first save) is passed over, said in `log`.

  Raises:
    FileNotFoundError: there are none (the message names the empty directories, if any, and
      what to give instead).
  """
  root = pathlib.Path(init_from)
  if not root.exists():
    raise FileNotFoundError(
        f"init_from={init_from!r} does not exist: give the workdir of a pretraining run (e.g. "
        "runs/tiny after python -m experiments.stage_8k --preset=tiny), or leave init_from "
        "unset to start from scratch")
  stages = [d / "checkpoints" for d in stage_dirs_with_checkpoints(root)] if root.is_dir() \
      else []
  empty = sorted(d for d in root.glob("*/checkpoints") if d.is_dir() and d not in stages)
  if not stages and empty:
    raise FileNotFoundError(
        f"init_from={init_from!r}: {', '.join(map(str, empty))} holds no checkpoint yet (the "
        "run stopped before its first save): run it until it saves one (rerun its command: "
        "it resumes), or give another pretraining workdir, or leave init_from unset to start "
        "from scratch")
  if not stages:
    raise FileNotFoundError(
        f"init_from={init_from!r} holds no <stage>/checkpoints: give the workdir of a "
        "pretraining run (e.g. runs/tiny after python -m experiments.stage_8k --preset=tiny), "
        "or leave init_from unset to start from scratch")
  if empty and log is not None:
    log(f"init_from: {', '.join(map(str, empty))} holds no checkpoint yet (passed over); "
        f"using the newest stage that has one, {stages[-1].parent.name}")
  return stages


def _same_model(meta: dict, model_cfg, stage: pathlib.Path) -> None:
  """Raise ConfigMismatchError when the init_from checkpoint `meta` (of `stage`) holds another
  model than `model_cfg`, naming the fields and the --preset / --set that match."""
  try:
    check_model(meta, model_cfg, f"init_from {stage.parent}")
  except ConfigMismatchError as e:
    raise ConfigMismatchError(
        f"{str(e).split('. A checkpoint cannot')[0]}. The RL model must be the pretrained "
        "one: build it with the checkpoint's settings (--preset, and --set "
        "model_overrides='[[\"field\", value], ...]' for the fields listed), or leave "
        "init_from unset to start from scratch.") from None


def check_init_from_model(cfg: RLConfig) -> None:
  """`_same_model` on the meta of the newest readable checkpoint of init_from's newest stage,
  before the model is built: `--preset=small --init_from` a tiny run built the 1.6B-parameter
  model and its optimizer state before the restore refused it (7.8 GB resident when a 10 GB
  limit stopped it, in a newcomer's run, 2026-12-07). Steps whose meta cannot be read are left to the restore.

  Raises:
    ConfigMismatchError: as `_same_model`.
    FileNotFoundError: init_from holds no checkpoint (`pretraining_stages`).
  """
  stage = pretraining_stages(cfg.init_from)[-1]
  model_cfg = get_preset(cfg.preset, **dict(cfg.model_overrides))
  ckpt = Checkpointer(stage, async_save=False)
  try:
    for step in reversed(ckpt.all_steps()):
      try:
        meta = dict(ckpt.read_meta(step))
      except Exception:  # pylint: disable=broad-except  (corrupt: the restore reports it)
        continue
      _same_model(meta, model_cfg, stage)
      return
  finally:
    ckpt.close()


def _init_from_pretraining(model, cfg: RLConfig, log=print):
  """Weights and balancer biases of the newest checkpoint in cfg.init_from (any stage, or an
  RL workdir's newest phase), with one log line naming the stage or phase and the step.

  Raises:
    ConfigMismatchError: the checkpoint holds another model than cfg.preset with
      cfg.model_overrides builds (the message lists the fields and the --set that matches).
    FileNotFoundError: no stage of cfg.init_from holds a checkpoint (`pretraining_stages`).
    UnreadableCheckpointError: none of the newest stage's checkpoints can be read (nothing in
      init_from is moved: it is only read).
  """
  stages = pretraining_stages(cfg.init_from, log)
  _, _, state = _fresh_state(model, OptimizerConfig(), 1, cfg.seed)
  ckpt = Checkpointer(stages[-1], async_save=False)
  try:  # a reader: an unreadable step of another run is never moved aside
    restored = _restore(ckpt, state, lambda meta: _same_model(meta, model.cfg, stages[-1]),
                        set_aside=False)
  finally:
    ckpt.close()
  if restored is None:  # removed since it was listed
    raise FileNotFoundError(f"init_from={cfg.init_from!r}: {stages[-1]} holds no checkpoint "
                            "any more; rerun to use the newest stage that has one")
  meta = restored[2]
  what = (f"RL phase {meta['phase']!r}" if "phase" in meta and "stage" not in meta else
          f"pretraining stage {stages[-1].parent.name!r}")
  log(f"init_from: the weights of {what} step {meta.get('step')}"
      f"{' (final)' if meta.get('final') else ' (not its final step)'} in {stages[-1]}")
  graphdef, _, _ = split_model(model)
  return nnx.merge(graphdef, restored[0].params, restored[0].model_vars)


def check_saved_phases(cfg: RLConfig, workdir: pathlib.Path) -> None:
  """`check_resume` on the newest checkpoint of each phase in `workdir` (its meta only), before
  anything is built or evaluated: a finished workdir rerun with another GRPO setting was
  refused only after the SFT phase was restored and its held-out eval rerun (and
  sft/eval.json rewritten). Steps whose meta cannot be read are left to the restore.

  Raises:
    ConfigMismatchError: as check_resume.
  """
  for phase in PHASES:
    directory = workdir / phase / "checkpoints"
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()),
                   reverse=True) if directory.is_dir() else []
    if not steps:
      continue
    ckpt = Checkpointer(directory, async_save=False)
    try:
      for step in steps:
        try:
          meta = dict(ckpt.read_meta(step))
        except Exception:  # pylint: disable=broad-except  (corrupt: restore_latest reports it)
          continue
        check_resume(meta, cfg, phase)
        break
    finally:
      ckpt.close()


def evaluate(engine, tok, model, cfg: RLConfig, *, num_tasks: int | None = None) -> dict:
  """Held-out greedy success rate, mean reward and malformed-call rate."""
  env = cfg.env_instance()
  rng = _rng(cfg, "eval", EVAL_SEED_OFFSET)
  tasks = [env.sample(rng) for _ in range(num_tasks or cfg.eval_tasks)]
  engine.load_weights(model)
  eps = rollout.run_episodes(engine, tok, tasks, max_steps=env.max_steps,
                             max_turn_tokens=cfg.max_turn_tokens, max_length=cfg.seq_len,
                             temperature=0.0, seed=0)
  n = len(eps)
  return {"success": sum(e.success for e in eps) / n, "reward": sum(e.reward for e in eps) / n,
          "errors_per_episode": sum(e.num_errors for e in eps) / n, "episodes": n}


class _Bar:
  """A rich progress bar whose text shows the latest metrics (off: nothing is drawn)."""

  def __init__(self, total: int, start: int, description: str, enabled: bool):
    self._bar = None
    if enabled:
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress,  # pylint: disable=import-outside-toplevel
                                 TextColumn, TimeRemainingColumn)
      self._bar = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[info]}"), TimeRemainingColumn())
      self._task = self._bar.add_task(description, total=total, completed=start, info="")
      self._bar.start()

  def update(self, step: int, info: str | None = None) -> None:
    if self._bar is not None:
      self._bar.update(self._task, completed=step, **({} if info is None else {"info": info}))

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()


class Preempted(RuntimeError):
  """A SIGTERM / SIGINT stopped a phase after it saved its state (the message says where);
  running the same command again resumes it."""


class _Phase:
  """One phase's checkpoints, TensorBoard writer and progress bar, and its (restored) state.
  preemption: a `sparse_lm.train.loop.Preemption` (or None): once its `stop_after(step)` names
  a signal (on every process at the same step in a multi-process job), the phase saves after
  that step and raises Preempted."""

  def __init__(self, cfg: RLConfig, workdir: pathlib.Path, name: str, model,
               optim: OptimizerConfig, steps: int, progress: bool, preemption=None, tok=None,
               log=print):
    self.name, self.steps, self.every = name, steps, cfg.checkpoint_every
    self.preemption = preemption
    self.graphdef, self.tx, self.state = _fresh_state(model, optim, steps, cfg.seed)
    self.schedule = wsd_schedule(optim, steps)
    self.ckpt = Checkpointer(workdir / name / "checkpoints", async_save=False)
    # The model config and the tokenizer too, as a pretraining stage's checkpoints record
    # them: a phase's checkpoint loads on its own (`python -m sparse_lm.generate --workdir W
    # --stage grpo`, `sparse_lm.generate.load_checkpoint`, the HF export).
    self.meta = {"phase": name, "rl": to_json(cfg), "model": to_json(model.cfg)}
    if tok is not None:
      self.meta["tokenizer"] = {"fingerprint": tok.fingerprint, "json": tok.to_json()}
    restored = _restore(self.ckpt, self.state, lambda m: check_resume(m, cfg, name))
    if restored is not None:
      self.state = restored[0]
      step = int(self.state.step)
      log(f"[{name}] resuming from step {step} of {steps} ({self.ckpt.directory})"
          if step < steps else f"[{name}] finished at step {step}: restored from "
          f"{self.ckpt.directory}")
    self.writer = MetricsWriter(workdir / name / "tb", after_step=int(self.state.step))
    self.bar = _Bar(steps, int(self.state.step), name, progress)

  def check_finite(self, step: int, metrics: dict) -> None:
    """Stop the phase when step `step` (0-based) had a non-finite loss or gradient norm.

    The step function then kept the old state (its `finite` metric is 0), so the phase would go
    on with a step count behind the loop's and write its last checkpoints under old step
    numbers; as the pretraining loop does, it stops instead, keeping its checkpoints.

    Raises:
      NonFiniteLossError (a FloatingPointError): naming the phase, the step, the loss and
        gradient norm, and the last good checkpoint.
    """
    m = {k: float(np.asarray(jax.device_get(metrics[k]))) for k in ("finite", "loss",
                                                                     "grad_norm")}
    if m["finite"] and math.isfinite(m["loss"]):
      return
    steps = self.ckpt.all_steps()
    self.close()
    kept = (f"the last good checkpoint is step {steps[-1]} in {self.ckpt.directory}" if steps
            else "no checkpoint had been saved yet")
    raise NonFiniteLossError(
        f"[{self.name}] non-finite loss ({m['loss']}) or gradient norm ({m['grad_norm']}) at "
        f"step {step} (0-based, the {step + 1}-th step of this phase); training stopped and "
        f"the update was not applied; {kept}.")

  def end_step(self, step: int, state: TrainState, info: str | None = None) -> None:
    """After step `step` (0-based): update the bar; save every `checkpoint_every` and at the
    end (marked final)."""
    self.state = state
    self.bar.update(step + 1, info)
    signal_name = self.preemption.stop_after(step + 1) if self.preemption is not None else None
    if (step + 1) % self.every == 0 or step + 1 == self.steps or signal_name:
      self.ckpt.save(state, data_state={"step": step + 1}, meta=self.meta,
                     final=step + 1 == self.steps)
    if signal_name and step + 1 < self.steps:
      self.close()
      raise Preempted(f"[{self.name}] {signal_name}: saved step {step + 1} to "
                      f"{self.ckpt.directory}; run the same command again to resume.")

  def close(self):
    """The model with the phase's final weights."""
    self.bar.close()
    self.ckpt.close()
    self.writer.close()
    return nnx.merge(self.graphdef, self.state.params, self.state.model_vars)


def _put(batch: dict) -> dict:
  return {k: jnp.asarray(v) for k, v in batch.items()}


def run_sft(cfg: RLConfig, workdir: pathlib.Path, model, tok, log=print,
            progress: bool = False, preemption=None) -> Any:
  """The SFT phase; returns the model with its final weights. Raises Preempted (after a
  save) once `preemption` has a signal, NonFiniteLossError at a step whose loss or gradient
  is not finite (`_Phase.check_finite`)."""
  env = cfg.env_instance()
  phase = _Phase(cfg, workdir, "sft", model, cfg.sft_optim, cfg.sft_steps, progress,
                 preemption, tok, log)
  step_fn = jax.jit(grpo.make_sft_step(phase.graphdef, phase.tx, phase.schedule),
                    donate_argnums=0)
  state, start, t0 = phase.state, int(phase.state.step), time.perf_counter()
  for step in range(start, cfg.sft_steps):
    rng = _rng(cfg, "sft", step)
    eps = []
    for _ in range(cfg.sft_batch):
      ids, gen = rollout.transcript(tok, env.sample(rng))
      eps.append(rollout.Episode(tokens=ids, generated=gen, logprobs=[0.0] * len(ids)))
    batch = grpo.episodes_to_batch(eps, None, cfg.sft_seq_len or cfg.seq_len)
    state, metrics = step_fn(state, _put({k: batch[k] for k in
                                          ("tokens", "segment_ids", "positions", "loss_mask")}))
    phase.check_finite(step, metrics)
    if (step + 1) % 10 == 0 or step + 1 == cfg.sft_steps:
      m = jax.device_get(metrics)
      phase.writer.write(step + 1, {"loss": m["loss"], "accuracy": m["accuracy"],
                                    "grad_norm": m["grad_norm"]})
      info = f"loss {float(m['loss']):.4f} acc {float(m['accuracy']):.3f}"
      log(f"sft {step + 1}/{cfg.sft_steps} {info} ({time.perf_counter() - t0:.0f} s)")
      phase.bar.update(step + 1, info)
    phase.end_step(step, state)
  return phase.close()


def make_logp_fn(graphdef):
  """Jitted `(params, model_vars, tokens, segment_ids, temperature) -> grpo.token_logprobs`
  (the temperature is traced: one compile serves T = 1 and the sampling T)."""
  return jax.jit(lambda p, r, t, s, temp: grpo.token_logprobs(
      nnx.merge(graphdef, p, r), t, s, temperature=temp))


def grpo_batch(eps, rewards, cfg: RLConfig, logp_fn, state: TrainState, ref=None):
  """(the GRPO step's device batch, engine-vs-trainer max |delta log p|) for one step's episodes
  (grouped: `cfg.grpo.group_size` consecutive episodes per prompt) and their rewards.

  The advantages are group-relative (`grpo.group_advantages`); `old_logprobs` become the
  trainer's log-probs of the sampling policy softmax(logits / T) on `state`'s weights (the
  ones the episodes were sampled with), the engine's own (T = 1) when T = 1; `ref_logprobs`
  those of `ref` = (params, model_vars) when given (KL to a frozen policy). The mismatch
  compares the episodes' T = 1 log-probs with the trainer's on every model-written token.
  """
  adv = grpo.group_advantages(rewards, cfg.grpo.group_size, scale_by_std=cfg.grpo.scale_by_std,
                              eps=cfg.grpo.eps)
  batch = _put(grpo.episodes_to_batch(eps, adv, cfg.seq_len))
  ids = (batch["tokens"], batch["segment_ids"])
  trainer_lp = logp_fn(state.params, state.model_vars, *ids, 1.0)
  mask = batch["loss_mask"] > 0
  mismatch = float(jnp.max(jnp.where(mask, jnp.abs(trainer_lp - batch["old_logprobs"]), 0)))
  temp = cfg.grpo.temperature
  if temp != 1.0:  # the ratio's old policy is the sampling one, softmax(logits / T)
    batch["old_logprobs"] = logp_fn(state.params, state.model_vars, *ids, temp)
  if ref is not None:
    batch["ref_logprobs"] = logp_fn(*ref, *ids, temp)
  return batch, mismatch


def run_grpo(cfg: RLConfig, workdir: pathlib.Path, model, tok, engine, log=print,
             progress: bool = False, preemption=None) -> tuple:
  """The GRPO phase from `model` (the SFT result), which is also the frozen reference policy of
  the KL term (`grpo.kl_coef > 0`), in a resumed phase too; returns (model, per-step metrics).
  Raises Preempted (after a save) once `preemption` has a signal, NonFiniteLossError at a
  step whose loss or gradient is not finite (`_Phase.check_finite`)."""
  env = cfg.env_instance()
  G, P = cfg.grpo.group_size, cfg.prompts_per_step
  # The KL reference is the frozen SFT policy, `model`, taken before the phase restores a
  # resumed run's GRPO state (which it is not). A copy: the step donates (deletes) the state's
  # buffers, which are `model`'s own in a fresh phase; the reference must outlive them.
  ref = None
  if cfg.grpo.kl_coef > 0:
    _, ref_params, ref_vars = split_model(model)
    ref = jax.tree.map(jnp.copy, (ref_params, ref_vars))
  phase = _Phase(cfg, workdir, "grpo", model, cfg.grpo_optim, cfg.grpo_steps, progress,
                 preemption, tok, log)
  graphdef, state = phase.graphdef, phase.state
  step_fn = jax.jit(grpo.make_grpo_step(graphdef, phase.tx, phase.schedule, cfg.grpo),
                    donate_argnums=0)
  logp_fn = make_logp_fn(graphdef)
  history = []
  curve = workdir / "grpo" / "eval_curve.jsonl"
  start = int(state.step)
  # a resumed phase repeats the steps after its checkpoint: their old evals are dropped
  drop_lines_after(curve, start)
  if _curve_step(cfg, start) and start not in _curve_steps(curve):
    # A signal at an eval step saves that step and stops before its eval (a prompt stop; the
    # eval is `eval_tasks` episodes); the resumed phase runs it first, on the restored weights
    # (the same ones), so eval_curve.jsonl keeps every point.
    _curve_eval(engine, tok, nnx.merge(graphdef, state.params, state.model_vars), cfg, curve,
                start, log)
  for step in range(start, cfg.grpo_steps):
    rng = _rng(cfg, "grpo", step)
    tasks = [t for t in (env.sample(rng) for _ in range(P)) for _ in range(G)]
    engine.load_weights(nnx.merge(graphdef, state.params, state.model_vars))
    t0 = time.perf_counter()
    eps = rollout.run_episodes(engine, tok, tasks, max_steps=env.max_steps,
                               max_turn_tokens=cfg.max_turn_tokens, max_length=cfg.seq_len,
                               temperature=cfg.grpo.temperature,
                               seed=cfg.seed * 100_003 + step)
    gen_s = time.perf_counter() - t0
    generated = sum(sum(e.generated) for e in eps)
    rewards = grpo.episode_rewards(eps, cfg.partial_credit)
    batch, mismatch = grpo_batch(eps, rewards, cfg, logp_fn, state, ref)
    t1 = time.perf_counter()
    state, metrics = step_fn(state, batch)
    phase.check_finite(step, metrics)
    m = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
    record = {"reward": float(np.mean(rewards)),
              "success": float(np.mean([e.success for e in eps])),
              "errors_per_episode": float(np.mean([e.num_errors for e in eps])),
              "calls_per_episode": float(np.mean([e.num_calls for e in eps])),
              "rollout_tokens_per_s": generated / gen_s, "train_s": time.perf_counter() - t1,
              "logprob_mismatch_max": mismatch, "loss": m["loss"], "kl": m["kl"],
              "clip_frac": m["clip_frac"], "grad_norm": m["grad_norm"]}
    history.append(record)
    phase.writer.write(step + 1, record)
    info = (f"reward {record['reward']:.3f} success {record['success']:.3f} "
            f"{record['rollout_tokens_per_s']:.0f} tok/s |dlogp| {mismatch:.1e}")
    log(f"grpo {step + 1}/{cfg.grpo_steps} {info}")
    phase.end_step(step, state, info)
    if _curve_step(cfg, step + 1):
      _curve_eval(engine, tok, nnx.merge(graphdef, state.params, state.model_vars), cfg, curve,
                  step + 1, log)
  return phase.close(), history


def _curve_step(cfg: RLConfig, done: int) -> bool:
  """Whether GRPO evaluates after `done` steps (eval_curve.jsonl: every `eval_every` steps
  before the last; the last one's eval is eval.json)."""
  return bool(cfg.eval_every) and 0 < done < cfg.grpo_steps and done % cfg.eval_every == 0


def _curve_steps(path: pathlib.Path) -> set[int]:
  """The steps eval_curve.jsonl holds (none if it is missing; unreadable lines ignored)."""
  steps = set()
  if path.exists():
    for line in path.read_text(encoding="utf-8").splitlines():
      try:
        steps.add(int(json.loads(line)["step"]))
      except (ValueError, KeyError, TypeError):
        pass
  return steps


def _curve_eval(engine, tok, model, cfg: RLConfig, path: pathlib.Path, done: int, log) -> None:
  """The held-out eval after GRPO step `done`, appended to eval_curve.jsonl and logged."""
  ev = evaluate(engine, tok, model, cfg)
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({"step": done, **ev}) + "\n")
  log(f"held-out after grpo step {done}: {ev}")


def run(cfg: RLConfig, workdir: str, log=print, progress: bool = False) -> dict:
  """SFT, held-out eval, GRPO, held-out eval. Returns {"sft": eval, "grpo": eval, "history"}.

  The workdir is locked for the run (`<workdir>/run.lock`: a second run stops at once with
  WorkdirLockedError); SIGTERM / SIGINT save the current phase after its step and raise
  Preempted (run again to resume); one during the held-out eval after SFT raises Preempted once
  that eval is written, before GRPO is built (during the last eval the run just finishes).

  Raises (each before any compile or held-out eval):
    ValueError: an invalid config (RLConfig.validate), a URL workdir.
    NotAnRLWorkdirError (a ConfigMismatchError): the workdir holds a pretraining stage's
      checkpoints (`check_rl_workdir`), before anything is written there.
    ConfigMismatchError: a phase checkpoint of the workdir was written under another config
      (`check_saved_phases`, before the model is built), or init_from holds another model
      (`check_init_from_model`, before the tokenizer and the model are built).
    FileNotFoundError: init_from holds no checkpoint (`pretraining_stages`).
  """
  cfg.validate()
  t0 = time.perf_counter()
  from sparse_lm.inference import Engine  # pylint: disable=import-outside-toplevel
  from sparse_lm.model.transformer import Transformer  # pylint: disable=import-outside-toplevel
  wd = local_workdir(workdir)
  if cfg.init_from:
    local_workdir(cfg.init_from, "init_from")
    check_init_from_model(cfg)  # before the model (and its optimizer state) is built
  check_rl_workdir(wd)  # before the lock: nothing is written into another run's workdir
  with WorkdirLock(wd):  # before the tokenizer: a second run stops before any work
    model_cfg = get_preset(cfg.preset, **dict(cfg.model_overrides))
    tok = _tokenizer(cfg, wd, model_cfg.vocab_size, log)
    if tok.vocab_size > model_cfg.vocab_size:
      raise ValueError(f"tokenizer has {tok.vocab_size} ids > model vocab_size "
                       f"{model_cfg.vocab_size}")
    cfg = fit_lengths(cfg, tok, log)
    check_saved_phases(cfg, wd)  # a changed config is refused before any eval or compile
    for phase in PHASES:
      steps, optim = getattr(cfg, f"{phase}_steps"), getattr(cfg, f"{phase}_optim")
      if 0 < steps < optim.warmup_steps:
        log(f"warning: {phase}_optim.warmup_steps={optim.warmup_steps} > {phase}_steps={steps}: "
            f"the {phase} learning rate never reaches its peak {optim.peak_lr:g} (lower "
            f"{phase}_optim.warmup_steps)")
    model = Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed))
    if cfg.init_from:
      model = _init_from_pretraining(model, cfg, log)
    with Preemption() as preemption:
      model = run_sft(cfg, wd, model, tok, log=log, progress=progress, preemption=preemption)
      engine = Engine(model, max_length=cfg.seq_len,
                      max_batch=max(cfg.prompts_per_step * cfg.grpo.group_size, 1))
      out = {}
      for phase in PHASES:
        if phase == "grpo":
          model, out["history"] = run_grpo(cfg, wd, model, tok, engine, log=log,
                                            progress=progress, preemption=preemption)
        path = wd / phase / "eval.json"
        out[phase] = evaluate(engine, tok, model, cfg)
        out[phase]["wall_s"] = time.perf_counter() - t0  # since run() began: compiles, evals
        path.write_text(json.dumps(out[phase], indent=1))
        log(f"held-out after {phase}: {out[phase]}")
        signal_name = preemption.stop_after(-1) if phase != PHASES[-1] else None
        if signal_name:  # during the eval: stop before the next phase's compile and steps
          raise Preempted(f"[{phase}] {signal_name} during the held-out eval after {phase}: "
                          f"{phase} is saved and its eval written to {path}; run the same "
                          "command again to go on")
  return out
