"""Reading and writing (sharded) safetensors checkpoints one tensor at a time.

`CheckpointReader` reads `model.safetensors` or the shards listed by
`model.safetensors.index.json`; each `get` reads one tensor with `readinto` straight into its
NumPy array (the file format: an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the data), so reading a tensor costs that tensor's
bytes and no more (the `safetensors` package's `get_tensor` peaks at twice that: it reads into
a bytes object first). `ShardWriter` fills shards up to a byte budget with the package's
`save_file` (each shard as a temporary file, renamed when all are written) and writes the index
atomically (a temporary file, then `os.replace`); `close` removes the shards of an earlier
checkpoint in the same directory that the new index does not list, and `abort` the temporary
files of a write that failed.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
import tempfile

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from sparse_lm.interop import mxfp4

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64,
          "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_DENSE_ALIAS = re.compile(r"^(.*model\.layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")


class CheckpointReader:
  """Tensor names, shapes and values of a HF safetensors checkpoint directory.

  Names are canonicalised: a dense layer's FFN saved by transformers as
  `layers.{i}.block_sparse_moe.{gate,up,down}_proj.weight` reads as `layers.{i}.mlp.*`, and an
  MXFP4 pair `X.weight_packed` + `X.weight_scale` reads as `X.weight` (dequantized to fp32).

  Raises:
    FileNotFoundError: neither model.safetensors nor the index exists in `path`.
    ValueError: the index is not JSON or has no weight_map, or a shard is not a safetensors
      file (a Git LFS pointer, truncated: `read_header`), naming the file.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    if (self.path / INDEX).exists():
      files = _read_index(self.path / INDEX)
    elif (self.path / SINGLE).exists():
      files = {k: SINGLE for k in read_header(self.path / SINGLE)[0]}
    else:
      raise FileNotFoundError(f"{self.path}: no {SINGLE} or {INDEX}")
    self._files = files  # raw name -> file
    self._raw: dict[str, str] = {}  # canonical name -> raw name (for MXFP4: the packed one)
    self._mx: dict[str, str] = {}  # canonical name -> its weight_scale name
    self._headers: dict[str, tuple[dict, int]] = {}  # file -> (header, data offset)
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

  def check_mxfp4(self, names=None) -> None:
    """Check every MXFP4 pair among `names` (default: all) from the headers alone: both uint8,
    weight_scale [..., n/32] for weight_packed [..., n/2]. Raises ValueError naming the
    tensors (else a bad pair failed only when its value was read, after the other tensors,
    without its name)."""
    for name in sorted(self._mx if names is None else set(names) & set(self._mx)):
      packed, scale = self._raw[name], self._mx[name]
      ep, es = self._entry(packed)[2], self._entry(scale)[2]
      if ep["dtype"] != "U8" or es["dtype"] != "U8":
        raise ValueError(f"{self.path}: MXFP4 {packed} is {ep['dtype']} and {scale} is "
                         f"{es['dtype']}: both must be U8 (uint8)")
      sp, ss = list(ep["shape"]), list(es["shape"])
      n = sp[-1] * 2 if sp else 0
      if not sp or n % mxfp4.GROUP or ss != sp[:-1] + [n // mxfp4.GROUP]:
        raise ValueError(f"{self.path}: MXFP4 {scale} has shape {ss}, expected "
                         f"{sp[:-1] + [n // mxfp4.GROUP]} for {packed} of shape {sp} ({n} "
                         f"columns, one E8M0 scale per {mxfp4.GROUP})")

  def _entry(self, raw: str) -> tuple[str, int, dict]:
    fn = self._files[raw]
    if fn not in self._headers:  # one header read per file
      self._headers[fn] = read_header(self.path / fn)
    header, base = self._headers[fn]
    if raw not in header:
      raise ValueError(f"{self.path / fn}: the index lists {raw} but the file lacks it")
    return fn, base, header[raw]

  def shape(self, name: str) -> tuple[int, ...]:
    """Shape of a (canonical) tensor, from the file header; MXFP4 gives the unpacked shape."""
    s = tuple(self._entry(self._raw[name])[2]["shape"])
    return s[:-1] + (s[-1] * 2,) if name in self._mx else s

  def _read(self, raw: str) -> np.ndarray:
    fn, base, e = self._entry(raw)
    if e["dtype"] not in DTYPES:
      raise ValueError(f"{raw}: safetensors dtype {e['dtype']} is not supported")
    out = np.empty(e["shape"], DTYPES[e["dtype"]])
    start, end = e["data_offsets"]
    if end - start != out.nbytes:
      raise ValueError(f"{raw}: {end - start} bytes on disk for shape {e['shape']} "
                       f"{e['dtype']}")
    with open(self.path / fn, "rb") as f:
      f.seek(base + start)
      if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != out.nbytes:
        raise ValueError(f"{self.path / fn}: truncated data for {raw}")
    return out

  def get(self, name: str) -> np.ndarray:
    """The tensor as a NumPy array in its stored dtype (MXFP4: dequantized fp32)."""
    value = self._read(self._raw[name])
    if name not in self._mx:
      return value
    return mxfp4.dequantize(value, self._read(self._mx[name]))


# The first line of a Git LFS pointer file: what `git clone` of a Hugging Face repository gives
# for each *.safetensors file when git-lfs is not installed (a ~130-byte text file).
LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def _read_index(path: pathlib.Path) -> dict[str, str]:
  """The weight_map of a model.safetensors.index.json; ValueError naming the file if it is not
  JSON (e.g. a Git LFS pointer) or has no weight_map."""
  try:
    index = json.loads(path.read_text(encoding="utf-8"))
  except ValueError as e:
    lfs = path.read_bytes().startswith(LFS_POINTER)
    raise ValueError(f"{path}: " + ("a Git LFS pointer file: run `git lfs pull` in "
                                   f"{path.parent}" if lfs else f"not valid JSON ({e})")) from None
  if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
    raise ValueError(f"{path}: no weight_map (not a safetensors index)")
  return index["weight_map"]


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
  """({name: {"dtype", "shape", "data_offsets"}}, offset of the data) of a safetensors file.

  Raises:
    ValueError: naming the file, when it is a Git LFS pointer (cloned without git-lfs: the
      message says to run `git lfs pull`), is shorter than its header length says or than the
      data its header lists (not a safetensors file, or truncated), or its header is not JSON.
      The header length is checked against the file size before the header is read (a random
      8 bytes asked for up to 2**64 bytes: MemoryError or OverflowError).
  """
  path = pathlib.Path(path)
  size = path.stat().st_size
  with open(path, "rb") as f:
    if f.read(len(LFS_POINTER)) == LFS_POINTER:
      raise ValueError(f"{path}: a Git LFS pointer file, not the tensors (the repository was "
                       "cloned without git-lfs): run `git lfs install && git lfs pull` in "
                       f"{path.parent}, or download it with `huggingface-cli download`")
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{path}: {size} bytes: not a safetensors file (or truncated)")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
      raise ValueError(f"{path}: not a safetensors file, or truncated: its first 8 bytes give "
                       f"a header of {n:,} bytes, but the file has {size:,} bytes")
    try:
      header = json.loads(f.read(n))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
      raise ValueError(f"{path}: not a safetensors file: its header is not JSON ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: not a safetensors file: its header is not a JSON object")
  header.pop("__metadata__", None)
  ends = [e["data_offsets"][1] for e in header.values() if isinstance(e, dict)
          and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
          and isinstance(e["data_offsets"][1], int)]
  if ends and 8 + n + max(ends) > size:
    raise ValueError(f"{path}: truncated: its header lists {8 + n + max(ends):,} bytes of "
                     f"header and data, the file has {size:,} (an interrupted download?)")
  return header, 8 + n


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
    self._shards.append(list(self._cur))  # before the write: `abort` removes a partial file
    tmp = self.path / f"shard-{k:05d}.tmp"
    try:
      save_file(self._cur, tmp, metadata={"format": "pt"})
    except Exception as e:  # pylint: disable=broad-except
      # safetensors reports a failed write (a full disk) as SafetensorError("... (os error
      # 28)"): raised as the OSError it is, so callers can tell it from a bad tensor
      code = re.search(r"os error (\d+)", str(e))
      if isinstance(e, OSError) or code is None:
        raise
      raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(tmp)) from e
    self._cur, self._cur_bytes = {}, 0

  def abort(self) -> None:
    """Remove the temporary shard files of a write that failed (the directory's finished
    files are left as they were)."""
    for k in range(len(self._shards)):
      (self.path / f"shard-{k:05d}.tmp").unlink(missing_ok=True)
    self._shards, self._cur, self._cur_bytes = [], {}, 0

  def close(self) -> list[str]:
    """Flush, rename the shards to their final names, write the index (atomically) and remove
    the shards of an earlier checkpoint that the index does not list (and a single-file
    `model.safetensors`, which transformers would load before the index); returns the files."""
    try:
      if self._cur:
        self._flush()
    except BaseException:
      self.abort()
      raise
    n = len(self._shards)
    weight_map, files = {}, []
    umask = os.umask(0)
    os.umask(umask)
    for k, names in enumerate(self._shards):
      fn = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
      # safetensors writes owner-only files (0600); the shards get the mode of the config and
      # index beside them (0666 less the umask), so another user or container can read them
      os.chmod(self.path / f"shard-{k:05d}.tmp", 0o666 & ~umask)
      os.replace(self.path / f"shard-{k:05d}.tmp", self.path / fn)
      files.append(fn)
      weight_map.update({nm: fn for nm in names})
    index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomic(self.path / INDEX, json.dumps(index, indent=2) + "\n")
    for old in [*self.path.glob("model-*-of-*.safetensors"), self.path / SINGLE]:
      if old.name not in files and old.is_file():
        old.unlink()  # stale: another checkpoint's shard in the same directory
    return files


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Write `path` through a temporary file in its directory and `os.replace`: a reader sees
  the old file or the new one, never a part (mode 0666 less the umask, as `write_text`)."""
  path = pathlib.Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise
