"""An imported HF checkpoint as an Orbax checkpoint in a workdir, for stages and the engine.

`python -m sparse_lm.interop.hf import --hf_dir D --workdir W` writes `W/hf_import/`:
  params/, model_vars/   Orbax (StandardCheckpointer) trees of the model's nnx.Param and other
                         variables (balancer bias and statistics), as nnx pure dicts;
  sparse_lm_model.json   {"model_config": the ModelConfig fields, "hf_extra": token ids};
  tokenizer.json         the checkpoint's own tokenizer (sparse_lm.data.tokenizer_hf), when it
                         ships a tokenizer.json or tiktoken.model.
A training stage starts from it with `--set init_from=W` (StageConfig.init_from): the stage's
model is the imported ModelConfig with the stage's `model_overrides` applied, its parameters
and balancer state are restored into the stage's shardings, and the optimizer starts fresh;
its data tokenizer is the import's (unless the stage sets data.tokenizer).
`python -m sparse_lm.generate --workdir W` generates with the import and its tokenizer.

`load_stage_checkpoint` reads a training stage's checkpoint back for export without importing
sparse_lm.train (same floor: train imports this module): the ModelConfig from the checkpoint's
`meta` item, the parameters and model variables from its `state` item.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import TYPE_CHECKING

from flax import nnx  # the model is imported only where one is built (StageConfig reads this)

from sparse_lm.config import ModelConfig, model_config_from_json
from sparse_lm.interop import hf_config

if TYPE_CHECKING:
  from sparse_lm.data import Tokenizer

IMPORT_DIR = "hf_import"
META = "sparse_lm_model.json"
TOKENIZER = "tokenizer.json"


def _dir(workdir) -> pathlib.Path:
  """The import directory of workdir W: W/hf_import, or W itself when W is that directory."""
  p = pathlib.Path(workdir).absolute()
  if p.name == IMPORT_DIR and (p / META).exists():
    return p
  return p / IMPORT_DIR


def imported_config(workdir) -> ModelConfig | None:
  """The ModelConfig of `workdir`'s import, or None if `workdir` holds none."""
  if not workdir or not (_dir(workdir) / META).exists():
    return None
  return ModelConfig(**json.loads((_dir(workdir) / META).read_text())["model_config"])


def checkpoint_tokenizer(hf_dir):
  """The tokenizer shipped in HF checkpoint `hf_dir` (tokenizer.json or tiktoken.model, with
  tokenizer_config.json), or None if it ships none.

  Raises:
    ValueError: it has more ids than config.json's vocab_size (the model could not embed
      them), or its files (or config.json) are malformed (named).
  """
  from sparse_lm.data import tokenizer_hf  # pylint: disable=g-import-not-at-top
  d = pathlib.Path(hf_dir)
  if not any((d / f).is_file() for f in ("tokenizer.json", "tiktoken.model")):
    return None
  tok = tokenizer_hf.HFCheckpointTokenizer.from_directory(d)
  raw = hf_config.read_config_json(d)
  vocab = raw.get("text_config", raw).get("vocab_size")
  if vocab is not None and tok.vocab_size > vocab:
    raise ValueError(f"{d}: the tokenizer has {tok.vocab_size} ids but config.json vocab_size "
                     f"is {vocab}: the tokenizer files do not belong to this checkpoint")
  return tok


def tokenizer_path(workdir) -> str | None:
  """`<workdir>/hf_import/tokenizer.json` if the import recorded a tokenizer, else None (a
  `DataConfig.tokenizer` value)."""
  path = _dir(workdir) / TOKENIZER if workdir else None
  return str(path) if path is not None and path.is_file() else None


def data_config(data_cfg, init_from: str | None):
  """`data_cfg` (a DataConfig) with the tokenizer of the HF import `init_from` when the stage
  starts from one that recorded a tokenizer and sets no `tokenizer` itself; else unchanged."""
  path = tokenizer_path(init_from) if init_from and data_cfg.tokenizer is None else None
  return dataclasses.replace(data_cfg, tokenizer=path) if path else data_cfg


def save_import(model: nnx.Module, cfg: ModelConfig, raw_config: dict, workdir, *,
                tokenizer=None) -> pathlib.Path:
  """Write an imported model (`hf.load_pretrained`), its config.json dict `raw_config` and
  the checkpoint's tokenizer (a `sparse_lm.data.Tokenizer` or None) as `<workdir>/hf_import/`;
  returns that directory."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from sparse_lm.interop.safetensors_io import write_text_atomic  # pylint: disable=g-import-not-at-top
  out = _dir(workdir)
  out.mkdir(parents=True, exist_ok=True)
  # The meta file marks a complete import: removed first, written last (atomically), so an
  # import that stops half-way (over an earlier one) leaves "no HF import", never an earlier
  # config over new weights, or the new weights with the earlier tokenizer.
  (out / META).unlink(missing_ok=True)
  (out / TOKENIZER).unlink(missing_ok=True)  # also what a re-import without one must leave
  _, params, rest = nnx.split(model, nnx.Param, ...)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(out / "params", nnx.to_pure_dict(params), force=True)
    ckpt.save(out / "model_vars", nnx.to_pure_dict(rest), force=True)
  if tokenizer is not None:
    tokenizer.save(str(out / TOKENIZER))  # atomic
  meta = {"model_config": dataclasses.asdict(cfg), "hf_extra": hf_config.token_ids(raw_config)}
  write_text_atomic(out / META, json.dumps(meta, indent=2) + "\n")
  return out


# Model variables that hold balancer statistics (BalancerStats): accumulated between two
# balancer updates and reset by each, so a stage whose balancer settings differ from the
# import's (balancer, balancer_bins) starts them at zero instead of restoring them.
_STATS = ("balancer_hist", "balancer_load")


def _leaves(tree, prefix=()):
  """(path of str keys, leaf) of a nested dict."""
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _leaves(v, prefix + (str(k),))
  else:
    yield prefix, tree


def _nest(flat: dict) -> dict:
  out = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def _zeros(leaf):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
      jax.devices()[0])
  return jax.make_array_from_callback(
      leaf.shape, sharding, lambda idx: np.zeros(leaf.shape, leaf.dtype)[idx])


def _replicated(leaf):
  import jax  # pylint: disable=g-import-not-at-top
  sh = getattr(leaf, "sharding", None)
  if isinstance(sh, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def restore_variables(workdir, abstract_params: nnx.State, abstract_model_vars: nnx.State
                      ) -> tuple[nnx.State, nnx.State]:
  """(params, model_vars) of the import, restored into the abstract states' shapes and
  shardings (leaves are jax.ShapeDtypeStruct with `.sharding`, as a stage's restore target).

  The shapes are compared with the stored ones before any value is read. Balancer statistics
  (`balancer_hist`, `balancer_load`) whose shape or presence differs (a stage with another
  `balancer` or `balancer_bins`) start at zero, as after a balancer update.

  Raises:
    FileNotFoundError: no import in `workdir`.
    ValueError: a variable whose shape differs from the import's, or that one side lacks (a
      stage whose model_overrides change the architecture): the variable, both shapes and
      the fix are named.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  d = _dir(workdir)
  if not (d / META).exists():
    raise FileNotFoundError(f"{d}: no HF import (run python -m sparse_lm.interop.hf import)")
  out = []
  with ocp.StandardCheckpointer() as ckpt:
    for name, target in (("params", abstract_params), ("model_vars", abstract_model_vars)):
      state = nnx.State(target) if not isinstance(target, nnx.State) else target
      want = nnx.to_pure_dict(state)
      meta = ckpt.metadata(d / name)
      meta = getattr(meta, "item_metadata", meta)
      meta = getattr(meta, "tree", meta)
      stored = {p: tuple(m.shape) for p, m in _leaves(meta)}
      wanted = dict(_leaves(want))
      bad = []
      for p in sorted(set(wanted) | set(stored)):
        a = wanted[p].shape if p in wanted else None
        b = stored.get(p)
        if (a is None or b is None or tuple(a) != b) and p[-1] not in _STATS:
          bad.append(f"{'.'.join(p)}: the import has "
                     + (f"shape {list(b)}" if b is not None else "no such variable")
                     + ", the model " + (f"shape {list(a)}" if a is not None else "has none"))
      if bad:
        raise ValueError(
            f"{d}: the model to restore is not the import's architecture ({'; '.join(bad[:3])}"
            + (f"; {len(bad) - 3} more" if len(bad) > 3 else "") + "). A stage with "
            "init_from=<import> takes the import's ModelConfig (sparse_lm_model.json): drop "
            "the --set model.* overrides that change the architecture (num_experts, d_model, "
            "num_layers, ...); non-architecture ones (remat_policy, kda_chunk_size, balancer, "
            "balancer_bins, dtype, ...) may differ")
      same = {p for p in wanted if stored.get(p) == tuple(wanted[p].shape)}
      if same == set(wanted) == set(stored):
        restored = ckpt.restore(d / name, want)
      else:  # balancer statistics differ: read what is stored, keep what matches, zeros else
        arg = {p: wanted[p] if p in same else jax.ShapeDtypeStruct(
            stored[p], m.dtype, sharding=_replicated(next(iter(wanted.values()))))
               for p, m in _leaves(meta)}
        got = dict(_leaves(ckpt.restore(d / name, _nest(arg))))
        flat = {p: got[p] if p in same else _zeros(wanted[p]) for p in wanted}
        restored = _nest_like(want, flat)
      nnx.replace_by_pure_dict(state, restored)
      out.append(state)
  return out[0], out[1]


def _nest_like(tree, flat: dict, prefix=()):
  """`tree` (a nested dict) with each leaf replaced by flat[its path of str keys]."""
  if isinstance(tree, dict):
    return {k: _nest_like(v, flat, prefix + (str(k),)) for k, v in tree.items()}
  return flat[prefix]


def token_ids(workdir) -> dict:
  """The bos / eos / pad ids of the imported config.json ({} without an import)."""
  if not (_dir(workdir) / META).exists():
    return {}
  return json.loads((_dir(workdir) / META).read_text())["hf_extra"]


def load_from_workdir(workdir) -> tuple[nnx.Module, ModelConfig, dict]:
  """(model on the first device, cfg, HF token ids) of `workdir`'s import."""
  from sparse_lm.model.transformer import Transformer  # pylint: disable=g-import-not-at-top
  cfg = imported_config(workdir)
  if cfg is None:
    raise FileNotFoundError(f"{_dir(workdir)}: no HF import")
  graphdef, params, rest = nnx.split(
      nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  params, rest = restore_variables(workdir, params, rest)
  extra = json.loads((_dir(workdir) / META).read_text())["hf_extra"]
  return nnx.merge(graphdef, params, rest), cfg, extra


def _unwrap(tree):
  """An Orbax-restored nnx state dict -> nnx pure dict (drop the `value` wrappers)."""
  if isinstance(tree, dict):
    if set(tree) == {"value"} and not isinstance(tree["value"], dict):
      return tree["value"]
    return {(int(k) if isinstance(k, str) and k.isdigit() else k): _unwrap(v)
            for k, v in tree.items()}
  return tree


def _stage_step_dir(workdir, stage: str | None) -> pathlib.Path:
  """The newest step directory of `stage` (default: the stage whose newest checkpoint is the
  most recent) under `workdir/<stage>/checkpoints/`; FileNotFoundError listing the stages."""
  return _stage_step_dirs(workdir, stage)[0]


def _stage_step_dirs(workdir, stage: str | None) -> list[pathlib.Path]:
  """The step directories of `stage` (chosen as `_stage_step_dir` does), newest first."""
  root = pathlib.Path(workdir).absolute()
  steps = [d for d in root.glob("*/checkpoints/*")
           if d.name.isdigit() and (d / "state").is_dir() and (d / "meta").is_dir()]
  names = sorted({d.parents[1].name for d in steps})
  if stage is not None:
    steps = [d for d in steps if d.parents[1].name == stage]
  if not steps:
    raise FileNotFoundError(f"no checkpoint of {stage or 'any stage'} in {root} (stages with "
                            f"checkpoints: {names or 'none'})")
  if stage is None:
    stage = max(steps, key=lambda d: d.stat().st_mtime).parents[1].name
  return sorted((d for d in steps if d.parents[1].name == stage), key=lambda d: -int(d.name))


def read_failure(e: BaseException) -> str:
  """A failed checkpoint read as one line: the error's type and the first line of its message
  without TensorStore's spec dump (" [tensorstore_spec ...", or a "<bound method ... spec of
  TensorStore({...})" repr), at most 300 characters of it (the training loop's checkpoint fallback uses it too)."""
  first = str(e).split("\n")[0]
  why = re.split(r" \[tensorstore_spec|<bound method|TensorStore\(\{", first)[0]
  return f"{type(e).__name__}: {why.rstrip(' ,:;(')[:300]}"


def _newest_readable(workdir, stage: str | None, read):
  """read(step_dir, meta) of the newest step of `stage` that can be read, as the training
  loop and `sparse_lm.train.load` fall back: a step that fails (a truncated or damaged write)
  is skipped with a RuntimeWarning naming it and the step used. Raises the newest step's error
  (with every step's reason) when none can be read."""
  import warnings  # pylint: disable=g-import-not-at-top
  dirs, failed = _stage_step_dirs(workdir, stage), []
  for step_dir in dirs:
    try:
      out = read(step_dir, _step_meta(step_dir))
    except Exception as e:  # pylint: disable=broad-except
      failed.append((step_dir, e, read_failure(e)))
      continue
    if failed:
      warnings.warn(
          f"{step_dir.parents[1].name}: step(s) "
          + ", ".join(f"{d.name} ({why})" for d, _, why in failed)
          + f" could not be read; using step {step_dir.name}", RuntimeWarning, stacklevel=3)
    return out
  raise RuntimeError(
      f"no checkpoint step of {dirs[0].parents[1].name} in {dirs[0].parents[1]} can be read: "
      + "; ".join(f"step {d.name}: {why}" for d, _, why in failed)) from failed[0][1]


def stage_tokenizer(workdir, stage: str | None = None):
  """The tokenizer saved with the checkpoint `load_stage_checkpoint(workdir, stage)` reads (a
  `sparse_lm.data.Tokenizer`; None if its meta holds none). Raises FileNotFoundError as that
  function does."""
  return _meta_tokenizer(_step_meta(_stage_step_dir(workdir, stage)))


def _step_meta(step_dir: pathlib.Path) -> dict:
  """The parsed meta of one checkpoint step directory."""
  return json.loads((step_dir / "meta" / "metadata").read_text())


def _meta_tokenizer(meta: dict):
  """The `sparse_lm.data.Tokenizer` a checkpoint's meta holds, or None."""
  from sparse_lm.data import Tokenizer  # pylint: disable=g-import-not-at-top
  saved = meta.get("tokenizer")
  return Tokenizer.from_json(saved["json"]) if saved else None


def load_stage_checkpoint(workdir, stage: str | None = None) -> tuple[nnx.Module, ModelConfig]:
  """(model on the first device, cfg) of the newest step of `stage` (default: the stage whose
  newest checkpoint is the most recent) under `workdir/<stage>/checkpoints/`; a step that
  cannot be read is skipped with a RuntimeWarning naming it and the step used.

  Raises:
    FileNotFoundError: no such checkpoint (the message lists the stages found).
    RuntimeError: none of the stage's steps can be read (each step's reason named).
  """
  return _newest_readable(workdir, stage, _load_step)


def load_stage_with_tokenizer(
    workdir, stage: str | None = None) -> tuple[nnx.Module, ModelConfig, "Tokenizer | None"]:
  """(model, cfg, tokenizer or None) of the checkpoint `load_stage_checkpoint` reads, the
  tokenizer (a `sparse_lm.data.Tokenizer`) from that same step's meta, as `stage_tokenizer`
  reads it: the step directory is resolved once, so a stage written meanwhile cannot pair one
  step's weights with another step's tokenizer. Falls back over unreadable steps as
  `load_stage_checkpoint` does.

  Raises:
    FileNotFoundError: no such checkpoint (the message lists the stages found).
    RuntimeError: none of the stage's steps can be read.
  """
  return _newest_readable(workdir, stage,
                          lambda step_dir, meta: (*_load_step(step_dir, meta),
                                                  _meta_tokenizer(meta)))


def _load_step(step_dir: pathlib.Path, meta: dict) -> tuple[nnx.Module, ModelConfig]:
  """(model on the first device, cfg) of one step directory, given its parsed meta."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from sparse_lm.model.transformer import Transformer  # pylint: disable=g-import-not-at-top
  cfg = model_config_from_json(meta["model"])
  graphdef, params, rest = nnx.split(
      nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  with ocp.StandardCheckpointer() as ckpt:
    saved = ckpt.restore(step_dir / "state")
  nnx.replace_by_pure_dict(params, _unwrap(saved["params"]))
  nnx.replace_by_pure_dict(rest, _unwrap(saved["model_vars"]))
  return nnx.merge(graphdef, params, rest), cfg
