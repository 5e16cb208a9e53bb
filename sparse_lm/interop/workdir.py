"""An imported HF checkpoint as an Orbax checkpoint in a workdir, for stages and the engine.

`python -m sparse_lm.interop.hf import --hf_dir D --workdir W` writes `W/hf_import/`:
  params/, model_vars/   Orbax (StandardCheckpointer) trees of the model's nnx.Param and other
                         variables (balancer bias and statistics), as nnx pure dicts;
  sparse_lm_model.json   {"model_config": the ModelConfig fields, "hf_extra": token ids}.
A training stage starts from it with `--set init_from=W` (StageConfig.init_from): the stage's
model is the imported ModelConfig with the stage's `model_overrides` applied, its parameters
and balancer state are restored into the stage's shardings, and the optimizer starts fresh.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from flax import nnx  # the model is imported only where one is built (StageConfig reads this)

from sparse_lm.config import ModelConfig
from sparse_lm.interop import hf_config

IMPORT_DIR = "hf_import"
META = "sparse_lm_model.json"


def _dir(workdir) -> pathlib.Path:
  return pathlib.Path(workdir).absolute() / IMPORT_DIR


def imported_config(workdir) -> ModelConfig | None:
  """The ModelConfig of `workdir`'s import, or None if `workdir` holds none."""
  if not workdir or not (_dir(workdir) / META).exists():
    return None
  return ModelConfig(**json.loads((_dir(workdir) / META).read_text())["model_config"])


def import_to_workdir(hf_dir, workdir, *, dtype: str | None = None) -> pathlib.Path:
  """HF checkpoint `hf_dir` -> `<workdir>/hf_import/`; returns that directory."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from sparse_lm.interop.hf import load_pretrained  # pylint: disable=g-import-not-at-top
  model, cfg = load_pretrained(hf_dir, dtype=dtype)
  out = _dir(workdir)
  out.mkdir(parents=True, exist_ok=True)
  _, params, rest = nnx.split(model, nnx.Param, ...)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(out / "params", nnx.to_pure_dict(params), force=True)
    ckpt.save(out / "model_vars", nnx.to_pure_dict(rest), force=True)
  raw = json.loads((pathlib.Path(hf_dir) / "config.json").read_text())
  meta = {"model_config": dataclasses.asdict(cfg), "hf_extra": hf_config.token_ids(raw)}
  (out / META).write_text(json.dumps(meta, indent=2) + "\n")
  return out


def restore_variables(workdir, abstract_params: nnx.State, abstract_model_vars: nnx.State
                      ) -> tuple[nnx.State, nnx.State]:
  """(params, model_vars) of the import, restored into the abstract states' shapes and
  shardings (leaves are jax.ShapeDtypeStruct with `.sharding`, as a stage's restore target).

  Raises:
    FileNotFoundError: no import in `workdir`. Orbax errors on a shape mismatch (a stage whose
      model_overrides change the architecture).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  d = _dir(workdir)
  if not (d / META).exists():
    raise FileNotFoundError(f"{d}: no HF import (run python -m sparse_lm.interop.hf import)")
  out = []
  with ocp.StandardCheckpointer() as ckpt:
    for name, target in (("params", abstract_params), ("model_vars", abstract_model_vars)):
      state = nnx.State(target) if not isinstance(target, nnx.State) else target
      restored = ckpt.restore(d / name, nnx.to_pure_dict(state))
      nnx.replace_by_pure_dict(state, restored)
      out.append(state)
  return out[0], out[1]


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
