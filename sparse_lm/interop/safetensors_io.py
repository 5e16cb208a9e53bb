"""Reading and writing (sharded) safetensors checkpoints one tensor at a time.

`CheckpointReader` reads `model.safetensors` or the shards listed by
`model.safetensors.index.json`; each `get` opens the file, copies one tensor out and closes it
(so no mapping of the whole shard stays resident). `ShardWriter` fills shards up to a byte
budget and writes the index. Uses the `safetensors` package's NumPy API.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from sparse_lm.interop import mxfp4

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DENSE_ALIAS = re.compile(r"^(.*model\.layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")


class CheckpointReader:
  """Tensor names, shapes and values of a HF safetensors checkpoint directory.

  Names are canonicalised: a dense layer's FFN saved by transformers as
  `layers.{i}.block_sparse_moe.{gate,up,down}_proj.weight` reads as `layers.{i}.mlp.*`, and an
  MXFP4 pair `X.weight_packed` + `X.weight_scale` reads as `X.weight` (dequantized to fp32).

  Raises:
    FileNotFoundError: neither model.safetensors nor the index exists in `path`.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    if (self.path / INDEX).exists():
      files = json.loads((self.path / INDEX).read_text())["weight_map"]
    elif (self.path / SINGLE).exists():
      with safe_open(self.path / SINGLE, framework="numpy") as f:
        files = {k: SINGLE for k in f.keys()}
    else:
      raise FileNotFoundError(f"{self.path}: no {SINGLE} or {INDEX}")
    self._files = files  # raw name -> file
    self._raw: dict[str, str] = {}  # canonical name -> raw name (for MXFP4: the packed one)
    self._mx: dict[str, str] = {}  # canonical name -> its weight_scale name
    self._shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # file -> raw name -> shape
    for name in files:
      if name.endswith(".weight_packed"):
        base = name[:-len("_packed")]
        if base + "_scale" not in files:
          raise ValueError(f"{self.path}: {name} has no {base}_scale")
        self._raw[base], self._mx[base] = name, base + "_scale"
      elif name.endswith(".weight_scale") and name[:-len("_scale")] + "_packed" in files:
        continue
      else:
        m = _DENSE_ALIAS.match(name)
        self._raw[f"{m.group(1)}mlp.{m.group(2)}" if m else name] = name

  def names(self) -> set[str]:
    return set(self._raw)

  def _open(self, name: str):
    return safe_open(self.path / self._files[name], framework="numpy")

  def shape(self, name: str) -> tuple[int, ...]:
    """Shape of a (canonical) tensor, from the file header; MXFP4 gives the unpacked shape."""
    raw = self._raw[name]
    fn = self._files[raw]
    if fn not in self._shapes:  # one header read per file
      with safe_open(self.path / fn, framework="numpy") as f:
        self._shapes[fn] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    s = self._shapes[fn][raw]
    return s[:-1] + (s[-1] * 2,) if name in self._mx else s

  def get(self, name: str) -> np.ndarray:
    """The tensor as a NumPy array in its stored dtype (MXFP4: dequantized fp32)."""
    raw = self._raw[name]
    with self._open(raw) as f:
      value = f.get_tensor(raw)
    if name not in self._mx:
      return value
    with self._open(self._mx[name]) as f:
      return mxfp4.dequantize(value, f.get_tensor(self._mx[name]))


class ShardWriter:
  """Writes tensors into `model-0000k-of-0000n.safetensors` shards of at most `max_bytes`
  (a larger tensor gets a shard of its own) and `model.safetensors.index.json`."""

  def __init__(self, path: str | os.PathLike, max_bytes: int = 2 << 30):
    self.path = pathlib.Path(path)
    self.path.mkdir(parents=True, exist_ok=True)
    self.max_bytes = max_bytes
    self._cur: dict[str, np.ndarray] = {}
    self._cur_bytes = 0
    self._shards: list[list[str]] = []
    self._total = 0

  def add(self, name: str, value: np.ndarray) -> None:
    if self._cur and self._cur_bytes + value.nbytes > self.max_bytes:
      self._flush()
    self._cur[name] = np.ascontiguousarray(value)
    self._cur_bytes += value.nbytes
    self._total += value.nbytes

  def _flush(self) -> None:
    k = len(self._shards)
    save_file(self._cur, self.path / f"shard-{k:05d}.tmp", metadata={"format": "pt"})
    self._shards.append(list(self._cur))
    self._cur, self._cur_bytes = {}, 0

  def close(self) -> list[str]:
    """Flush, rename the shards to their final names, write the index; returns the files."""
    if self._cur:
      self._flush()
    n = len(self._shards)
    weight_map, files = {}, []
    for k, names in enumerate(self._shards):
      fn = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
      os.replace(self.path / f"shard-{k:05d}.tmp", self.path / fn)
      files.append(fn)
      weight_map.update({nm: fn for nm in names})
    index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
    (self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files
