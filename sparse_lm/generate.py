"""Generate text from a trained checkpoint: `python -m sparse_lm.generate`.

    python -m sparse_lm.generate --workdir runs/tiny --prompt 'def '
    python -m sparse_lm.generate --checkpoint runs/tiny/stage_8k/checkpoints/500 --interactive

Loads the newest checkpoint of the newest stage in the workdir (the stage whose latest
checkpoint was written last; `--stage` picks another) through `sparse_lm.train.load`, or one
step directory `--checkpoint PATH`, with the tokenizer saved in it, and streams the completion.
A workdir that holds only an HF import (`python -m sparse_lm.interop.hf import`) generates with
the imported model and the tokenizer the checkpoint shipped; an RL run's workdir
(`python -m experiments.agentic_rl`) with its newest phase (`--stage sft` or `grpo`).
`--interactive` is a multi-turn chat: each turn continues the previous turn's decode state
(sparse_lm.inference.DecodeState), so the history is never re-read.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
from typing import Any, Sequence


def load_workdir(workdir: str | pathlib.Path, *, stage: str | None = None,
                 preset: str | None = None):
  """(model, tokenizer, description) of the newest checkpoint of `stage` (default: the stage
  written last) in a training workdir, through `sparse_lm.train.load`.

  Raises:
    FileNotFoundError: no checkpoint in `workdir` (the message lists its stages).
    ValueError: the checkpoint's preset differs from `preset`.
  """
  from sparse_lm.interop import workdir as hf_import
  from sparse_lm.train import load
  from sparse_lm.train.trained import NotAStageError

  try:
    model, tokenizer, stage_cfg = load(workdir, stage)
  except NotAStageError as e:  # an RL phase (sparse_lm.rl.trainer): its newest readable step
    return _load_phase(pathlib.Path(workdir), e.stage_dir.name, preset, e.meta)
  except FileNotFoundError:
    here = pathlib.Path(workdir)
    if (here / "checkpoints").is_dir():  # a stage's directory, not the workdir above it
      raise FileNotFoundError(
          f"{workdir} is a stage directory: pass --workdir {here.parent} --stage {here.name}, "
          f"or --checkpoint {here / 'checkpoints'}/<step>") from None
    if stage is not None or hf_import.imported_config(workdir) is None:
      raise
    return _load_import(workdir, preset)
  _check_preset(preset, stage_cfg.preset, f"{workdir} ({stage_cfg.name})")
  return model, tokenizer, f"{stage_cfg.name}, preset {stage_cfg.preset}: {workdir}"


def _load_phase(workdir: pathlib.Path, name: str, preset: str | None, meta: dict):
  """(model, tokenizer, description) of the newest readable checkpoint of an RL phase
  (`<workdir>/<name>`: `sft`, `grpo`; `meta`: its newest step's), whose meta records the
  model config and tokenizer (read as the HF export reads a stage:
  `interop.workdir.load_stage_with_tokenizer`)."""
  from sparse_lm.interop import workdir as hf_import
  from sparse_lm.train import checkpoint as ckpt_lib

  if "model" not in meta or "tokenizer" not in meta:
    raise _no_model_config(f"{workdir / name}: its newest checkpoint")
  try:
    model, cfg, tokenizer = hf_import.load_stage_with_tokenizer(workdir, name)
  except RuntimeError as e:  # no step can be read
    raise ckpt_lib.UnreadableCheckpointError(str(e)) from e
  _check_preset(preset, cfg.name, f"{workdir} ({name})")
  return model, tokenizer, f"{name} (RL phase), preset {cfg.name}: {workdir}"


def _load_import(workdir, preset: str | None):
  """(model, tokenizer, description) of a workdir holding only an HF import
  (`python -m sparse_lm.interop.hf import`), with the checkpoint's own tokenizer."""
  from sparse_lm.data import Tokenizer
  from sparse_lm.interop import workdir as hf_import

  path = hf_import.tokenizer_path(workdir)
  if path is None:
    raise FileNotFoundError(
        f"{workdir}: the HF import has no tokenizer (the checkpoint shipped neither "
        "tokenizer.json nor tiktoken.model); re-import a directory that has one")
  model, cfg, _ = hf_import.load_from_workdir(workdir)
  _check_preset(preset, cfg.name, f"{workdir} (HF import)")
  return model, Tokenizer.load(path), f"HF import ({cfg.name}): {workdir}"


def _check_preset(wanted: str | None, found: str, where) -> None:
  if wanted is not None and wanted != found:
    raise ValueError(f"--preset={wanted!r}, but checkpoint {where} holds a {found!r} model; "
                     f"drop --preset or pass --preset={found}")


def load_checkpoint(path: str | pathlib.Path, *, preset: str | None = None):
  """(model, tokenizer, meta) from one checkpoint step directory written by the training loop
  or by an RL phase (`sparse_lm.rl.trainer`).

  The model is built from the config saved in the checkpoint (a stage's preset and
  model_overrides; an RL phase's model config); params and the balancer state are restored
  (the optimizer state is read and dropped).

  Args:
    path: `<stage>/checkpoints/<step>`.
    preset: if given, the preset the caller expects; a checkpoint of another one is refused.

  Raises:
    FileNotFoundError: path is not a checkpoint step directory.
    ValueError: the checkpoint's preset differs from `preset`, its arrays do not fit the
      model its config describes, or it records no model config and tokenizer.
    UnreadableCheckpointError (a RuntimeError): its files cannot be read (truncated, corrupt).
  """
  import jax
  import orbax.checkpoint as ocp
  from flax import nnx

  from sparse_lm.data import Tokenizer
  from sparse_lm.model import Transformer
  from sparse_lm.train import checkpoint as ckpt_lib

  def read(what, args):
    try:
      return getattr(mgr.restore(step, args=args), what)
    except Exception as e:  # pylint: disable=broad-except  (any read failure: corrupt files)
      mgr.close()
      raise ckpt_lib.UnreadableCheckpointError(
          f"--checkpoint {path}: its {what} cannot be read ({ckpt_lib.read_failure(e)}); "
          "pass another step, or --workdir to take the newest readable one") from None

  path = pathlib.Path(path).absolute()
  if path.name.isdigit() and not path.is_dir():
    steps = (sorted((int(p.name) for p in path.parent.iterdir() if p.name.isdigit()))
             if path.parent.is_dir() else [])
    have = (f"the steps saved there: {', '.join(map(str, steps))}" if steps
            else f"{path.parent} holds no checkpoint step")
    raise FileNotFoundError(f"--checkpoint {path}: no such checkpoint; {have}")
  if not (path.is_dir() and path.name.isdigit()):
    steps = (sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir())
             if path.is_dir() else [])
    hint = (f"; the steps saved there: {', '.join(map(str, steps))} (e.g. --checkpoint "
            f"{path / str(steps[-1])})" if steps else "")
    raise FileNotFoundError(f"--checkpoint {path}: expected a step directory "
                            f"<workdir>/<stage>/checkpoints/<step>{hint}")
  mgr = ocp.CheckpointManager(path.parent)
  step = int(path.name)
  ckpt_lib.quiet_abandoned_reads()  # a failed read's other reads report late
  meta = read("meta", ocp.args.Composite(meta=ocp.args.JsonRestore()))
  cfg, found = _model_config(meta, path, mgr)
  _check_preset(preset, found, path)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, model_vars = nnx.split(abstract, nnx.Param, ...)
  state = read("state", ocp.args.Composite(state=ocp.args.StandardRestore()))
  mgr.close()
  def pure(tree):  # a restored Variable is {"value": array}
    if isinstance(tree, dict):
      if set(tree) == {"value"} and not isinstance(tree["value"], dict):
        return tree["value"]
      return {k: pure(v) for k, v in tree.items()}
    return tree

  try:
    nnx.replace_by_pure_dict(params, pure(state["params"]))
    nnx.replace_by_pure_dict(model_vars, pure(state["model_vars"]))
    model = nnx.merge(graphdef, params, model_vars)
    for (p, want), got in zip(jax.tree_util.tree_leaves_with_path(nnx.state(abstract)),
                              jax.tree.leaves(nnx.state(model))):
      if tuple(want.shape) != tuple(got.shape):
        raise ValueError(f"{jax.tree_util.keystr(p)}: {got.shape} vs {want.shape}")
  except (KeyError, ValueError) as e:
    raise ValueError(f"checkpoint {path} does not fit the {found!r} model its config "
                     f"describes ({e}); was it written by another version?") from e
  tokenizer = Tokenizer.from_json(meta["tokenizer"]["json"])
  return model, tokenizer, meta


def _model_config(meta: dict, path: pathlib.Path, mgr):
  """(ModelConfig, preset name) a checkpoint's meta records: a pretraining stage's config,
  else (an RL phase's checkpoint) the model config and the RL config's preset.

  Raises:
    ValueError: the meta records neither, or no tokenizer (an RL checkpoint written before
      RL phases recorded them, 2026-12-07).
  """
  from sparse_lm.config import model_config_from_json
  from sparse_lm.train.checkpoint import stage_from_json
  if "stage" in meta and "tokenizer" in meta:
    return stage_from_json(meta["stage"]).model_config(), meta["stage"]["preset"]
  if "model" in meta and "tokenizer" in meta:
    cfg = model_config_from_json(meta["model"])
    return cfg, (meta.get("rl") or {}).get("preset", cfg.name)
  mgr.close()
  raise _no_model_config(f"checkpoint {path}")


def _no_model_config(what: str) -> ValueError:
  return ValueError(
      f"{what} records no model config and tokenizer (an RL phase's checkpoint written "
      "before 2026-12-07, when they were added): build the model from its RL config (the "
      "meta's rl.preset and rl.model_overrides) and restore the checkpoint's params into it")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m sparse_lm.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="training workdir: the newest stage's newest checkpoint")
  src.add_argument("--checkpoint", help="a checkpoint step directory")
  p.add_argument("--stage", help="with --workdir: this stage (default: the one written last)")
  p.add_argument("--preset", help="refuse a checkpoint of another preset")
  p.add_argument("--prompt", default="", help="text to continue")
  p.add_argument("--interactive", action="store_true", help="multi-turn chat on stdin")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max-length", type=int, default=4096, help="tokens of history kept")
  p.add_argument("--prefill-chunk", type=int, default=512)
  return p


class TextStream:
  """Writes a completion's text to `out` as its tokens arrive, each character once.

  `decode` maps all the tokens so far to text. A burst of tokens can end inside a multi-byte
  UTF-8 character, which byte-level tokenizers decode as U+FFFD until its last byte arrives,
  so trailing U+FFFD characters are held back until the next update; `finish` writes them if
  they are still there. Should the decoder ever change text already written, the rest is
  written from where the two texts part (nothing already written is taken back).
  """

  def __init__(self, decode, out):
    self._decode, self._out, self.shown = decode, out, ""

  def _write(self, text: str) -> None:
    if self.shown.startswith(text):  # nothing new
      return
    common = len(os.path.commonprefix([text, self.shown]))
    self._out.write(text[common:])
    self._out.flush()
    self.shown = text

  def update(self, tokens) -> None:
    """All the completion's tokens so far: writes what is new, bar a cut character."""
    self._write(self._decode(tokens).rstrip("\ufffd"))

  def finish(self, tokens) -> None:
    """The completion's final tokens: writes whatever is still held back."""
    self._write(self._decode(tokens))


# The engine's argument names -> this CLI's flags, for its error messages.
_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
          "max_new_tokens": "--max-new-tokens", "max_length": "--max-length",
          "prefill_chunk": "--prefill-chunk"}


def _flag_message(err: ValueError) -> str:
  """`err`'s message in terms of the CLI's flags."""
  msg = str(err).replace("build the Engine with a larger max_length", "raise max_length")
  for name, flag in _FLAGS.items():
    msg = re.sub(rf"(?<![-\w]){name}\b", flag, msg)
  return msg


def _flag_error(parser: argparse.ArgumentParser, err: ValueError):
  """Exit with `err`'s message (status 2, as argparse) in terms of the CLI's flags."""
  parser.error(_flag_message(err))


def main(argv: Sequence[str] | None = None, out: Any = None) -> int:
  """Run the CLI; returns the exit status. `out` (default stdout) receives the text."""
  out = out or sys.stdout
  parser = _parser()
  args = parser.parse_args(argv)
  from sparse_lm.inference import Engine, SamplingParams

  try:
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if not 1 <= args.max_new_tokens < 2**31:
      raise ValueError(f"max_new_tokens={args.max_new_tokens} must be >= 1 (and < 2**31)")
    if not -2**63 <= args.seed < 2**63 - 2**20:  # the interactive turns add their number
      raise ValueError(f"--seed={args.seed} must be a 64-bit int")
    if args.max_length < 1 or args.prefill_chunk < 1:
      raise ValueError(f"max_length={args.max_length} and prefill_chunk={args.prefill_chunk} "
                       "must be >= 1")
  except ValueError as e:
    _flag_error(parser, e)
  if not args.interactive and not args.prompt:
    parser.error("--prompt is empty: give text to continue, or use --interactive")
  if args.checkpoint and args.stage:
    parser.error("--stage picks a stage of --workdir; --checkpoint names one step already: "
                 "drop --stage")
  try:  # a checkpoint of another preset, or one that does not fit its config: status 2
    if args.checkpoint:
      model, tokenizer, meta = load_checkpoint(args.checkpoint, preset=args.preset)
      name = meta["stage"]["name"] if "stage" in meta else f"{meta.get('phase')} (RL phase)"
      where = f"{name} step {meta.get('step')}: {args.checkpoint}"
    else:
      model, tokenizer, where = load_workdir(args.workdir, stage=args.stage, preset=args.preset)
  except ValueError as e:
    _flag_error(parser, e)
  print(f"[{where}]", file=sys.stderr)
  sampling = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                            top_p=sampling.top_p, stop_tokens=[tokenizer.eos_id])
  try:
    engine = Engine(model, max_length=args.max_length, max_batch=1,  # 16 tokens per burst
                    prefill_chunk=args.prefill_chunk, decode_steps=16)
  except ValueError as e:
    _flag_error(parser, e)

  def turn(text, state, seed, echo=""):
    """One turn: `echo` (the prompt) is written once the engine has accepted the input.
    Returns (state, whether the history is full); None for a line the engine refused in
    --interactive (the session goes on from the state before it)."""
    ids = tokenizer.encode(text)
    if state is None:
      ids = [tokenizer.bos_id] + ids
    text_out = TextStream(lambda t: tokenizer.decode(t, skip_special=True), out)
    pending = [echo]

    def stream(tokens):
      if pending:
        out.write(pending.pop())
      text_out.update(tokens)
    try:
      res = engine.generate([ids], max_new_tokens=args.max_new_tokens, sampling=sampling,
                            seed=seed, states=[state], stream=lambda _, t: stream(t))[0]
    except ValueError as e:
      if not args.interactive:
        _flag_error(parser, e)
      print(f"[not sent: {_flag_message(e)}]", file=sys.stderr)
      return None
    if pending:
      out.write(pending.pop())
    text_out.finish(res.tokens)
    out.write("\n")
    full = res.finish_reason == "max_length"
    if full:
      print(f"[stopped: the history reached --max-length {args.max_length} tokens"
            + ("; the session ends: start a new one or raise --max-length]" if args.interactive
               else "]"), file=sys.stderr)
    return res.state, full

  if not args.interactive:
    turn(args.prompt, None, args.seed, echo=args.prompt)
    return 0
  state, full = None, False
  if args.prompt:
    state, full = turn(args.prompt, None, args.seed, echo=args.prompt) or (None, False)
  n = 0
  while not full:  # a full history ends the session now, not after one more line is read
    line = sys.stdin.readline()
    if not line:
      break
    n += 1
    state, full = turn(line.rstrip("\n"), state, args.seed + n) or (state, False)
  return 0


def entry(argv=None) -> int | str:
  """`main` as the command runs it: a missing workdir or checkpoint, or checkpoints that cannot
  be read, return their message (sys.exit prints it and exits with status 1), no traceback."""
  try:
    return main(argv)
  except FileNotFoundError as e:  # a missing workdir / checkpoint: the message says what to do
    return f"python -m sparse_lm.generate: error: {e}"
  except RuntimeError as e:  # checkpoints that cannot be read: the message names them
    from sparse_lm.train.checkpoint import UnreadableCheckpointError
    if not isinstance(e, UnreadableCheckpointError):
      raise
    return f"python -m sparse_lm.generate: error: {e}"


if __name__ == "__main__":
  sys.exit(entry())
