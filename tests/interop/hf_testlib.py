"""Shared helpers of the interop tests: fixture paths, flat model state, checkpoint copies."""

import json
import pathlib
import shutil

import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "hf"
KIMI_LINEAR = DATA / "kimi_linear_tiny"
KIMI_LINEAR_REF = DATA / "kimi_linear_tiny_reference.npz"
K3 = DATA / "kimi_k3_tiny"
TAIL = DATA / "kimi_linear_tail"
TAIL_REF = DATA / "kimi_linear_tail_reference.npz"


def flat_state(model) -> dict:
  """path -> numpy value of every variable of an nnx model."""
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}


def read_all(path) -> dict[str, np.ndarray]:
  """Every tensor of a safetensors checkpoint directory, by its stored name."""
  path = pathlib.Path(path)
  index = path / "model.safetensors.index.json"
  files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
      else ["model.safetensors"]
  out = {}
  for fn in files:
    with safe_open(path / fn, framework="numpy") as f:
      for k in f.keys():
        out[k] = f.get_tensor(k)
  return out


def rewrite(src, dst, edit_tensors=None, edit_config=None) -> pathlib.Path:
  """Copy checkpoint `src` to `dst` as one model.safetensors, with the tensor dict and the
  config dict passed through the edit functions."""
  dst = pathlib.Path(dst)
  dst.mkdir(parents=True, exist_ok=True)
  t = read_all(src)
  if edit_tensors:
    t = edit_tensors(t)
  save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
  conf = json.loads((pathlib.Path(src) / "config.json").read_text())
  if edit_config:
    conf = edit_config(conf)
  (dst / "config.json").write_text(json.dumps(conf))
  return dst


def copy(src, dst) -> pathlib.Path:
  shutil.copytree(src, dst)
  return pathlib.Path(dst)
