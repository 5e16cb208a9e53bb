"""Import and export Hugging Face Kimi-Linear / Kimi-K3 checkpoints (HF_FORMATS.md).

    model, cfg = load_pretrained("Kimi-Linear-48B-A3B-Instruct/")       # or a K3 directory
    save_pretrained(model, cfg, "out/", layout="kimi_k3", quantize_experts=True)

`load_pretrained` maps config.json to a ModelConfig (hf_config.py), checks every expected
tensor's presence and shape against the safetensors headers (and that no unexpected tensor
is left over) before reading any value, then builds each variable with
`jax.make_array_from_callback`: each device shard is assembled from the HF tensors it needs,
read one at a time, so host memory holds one HF tensor plus one shard of its target.

CLI:
    python -m sparse_lm.interop.hf import --hf_dir D --workdir W [--ignore-keys K1,K2]
        # Orbax, see workdir.py
    python -m sparse_lm.interop.hf export --workdir W --out D [--layout kimi_k3] [--quantize]
        # the newest stage checkpoint in W (or --stage NAME; the import if W has none)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import pathlib
import re
import warnings

import jax
import numpy as np
from flax import nnx

from sparse_lm import sharding as shd
from sparse_lm.config import ModelConfig
from sparse_lm.fs import write_failure
from sparse_lm.interop import hf_config, hf_names, mxfp4, workdir
from sparse_lm.interop.safetensors_io import CheckpointReader, ShardWriter, write_text_atomic
from sparse_lm.model.transformer import Transformer

# HF tensors a text-model import leaves out on purpose (the K3 vision tower and projector).
_SKIPPED = re.compile(r"^(vision_tower|multi_modal_projector|mm_projector|model\.vision_tower)\.")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def _abstract(cfg: ModelConfig):
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  return graphdef, state


def _expected(srcs, flat) -> dict[str, tuple[int, ...]]:
  """HF name -> shape for every tensor the sources read."""
  out = {}
  for s in srcs:
    var = flat[s.path]
    block = tuple(var.shape[len(s.lead):])
    shapes = s.hf_shapes(block)
    for idx in itertools.product(*[range(n) for n in s.lead]):
      for name, shape in zip(s.names(idx), shapes):
        out[name] = shape
  return out


def check_tensors(reader: CheckpointReader, expected: dict[str, tuple[int, ...]]) -> None:
  """Raise ValueError naming the first missing, unexpected or wrongly shaped tensors (and an
  MXFP4 pair whose dtypes or scale shape are wrong), from the headers alone."""
  have = {n for n in reader.names() if not _SKIPPED.match(n)}
  missing = sorted(set(expected) - have)
  if missing:
    raise ValueError(f"{reader.path}: missing tensor(s) {missing[:5]} (of {len(missing)}); e.g. "
                     f"{missing[0]} should have shape {list(expected[missing[0]])}")
  extra = sorted(have - set(expected))
  if extra:
    raise ValueError(f"{reader.path}: unexpected tensor(s) {extra[:5]} (of {len(extra)}): the "
                     "config.json does not describe them (wrong config, or a layout sparse_lm "
                     "does not map)")
  for name, shape in expected.items():
    got = reader.shape(name)
    if got != tuple(shape):
      raise ValueError(f"{reader.path}: tensor {name} has shape {list(got)}, expected "
                       f"{list(shape)} from config.json")
  reader.check_mxfp4(expected)


def _shardings(cfg: ModelConfig, state, mesh):
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {p: one for p, _ in nnx.to_flat_state(state)}
  sh = shd.state_shardings(state, mesh)
  return {p: v.get_value() if hasattr(v, "get_value") else v[...]
          for p, v in nnx.to_flat_state(sh)}


def load_pretrained(path: str | os.PathLike, *, dtype: str | None = None, mesh=None,
                    ignore_keys: tuple[str, ...] = (), **overrides
                    ) -> tuple[Transformer, ModelConfig]:
  """A HF Kimi-Linear or Kimi-K3 checkpoint directory -> (Transformer, ModelConfig).

  Args:
    path: directory with config.json and model.safetensors or model.safetensors.index.json
      plus its shards. MXFP4 routed experts (weight_packed / weight_scale) are dequantized.
    dtype: "float32" or "bfloat16" (compute and parameter dtype); None reads config.json.
    mesh: a jax Mesh; each variable is created directly in its sharding (the rules of
      sparse_lm.sharding; call under `sharding.use_mesh(mesh, rules)` for custom rules).
      None: the first device.
    ignore_keys: config.json keys to accept unmapped (see hf_config.config_from_hf).
    **overrides: ModelConfig fields that config.json does not set (remat_policy, kda_backend,
      kda_chunk_size, scan_layers, balancer, ...), applied to the mapped config.

  Returns:
    (model, cfg). Variables HF does not store start as the model's own initial values
    (balancer statistics: zeros; AttnRes queries of a plain-residual model: zeros, unused).

  Raises:
    ValueError: a config key that cannot map, or a missing / unexpected / mis-shaped tensor
      (named), a config.json that is not JSON or a shard that is not a safetensors file (a Git
      LFS pointer, truncated; the file named), all before any tensor value is read.
    FileNotFoundError: no config.json or no safetensors in `path`.
  """
  path = pathlib.Path(path)
  if not (path / "config.json").exists():
    raise FileNotFoundError(f"{path}: no config.json")
  raw = hf_config.read_config_json(path)
  cfg, layout = hf_config.config_from_hf(raw, dtype=dtype, ignore_keys=ignore_keys)
  if overrides:
    mapped = set(overrides) & hf_config.MAPPED_FIELDS
    if mapped:
      raise ValueError(f"overrides {sorted(mapped)} are set by config.json; edit it instead")
    cfg = dataclasses.replace(cfg, **overrides)
  reader = CheckpointReader(path)
  graphdef, state = _abstract(cfg)
  flat = dict(nnx.to_flat_state(state))
  srcs = hf_names.sources(cfg, layout)
  check_tensors(reader, _expected(srcs, flat))
  shardings = _shardings(cfg, state, mesh)
  values = {}
  for s in srcs:
    var = flat[s.path]
    values[s.path] = _make_array(reader, s, var.shape, var.dtype, shardings[s.path])
  for p, var in flat.items():  # what HF does not store: zeros (the init of those variables)
    if p not in values:
      values[p] = jax.device_put(np.zeros(var.shape, var.dtype), shardings[p])
  new = [(p, var.replace(values[p])) for p, var in flat.items()]
  return nnx.merge(graphdef, nnx.from_flat_state(new)), cfg


def _make_array(reader, src: hf_names.Source, shape, dtype, sharding) -> jax.Array:
  nl = len(src.lead)
  block = tuple(shape[nl:])

  def callback(index):
    # One HF tensor at a time; `to_ours` returns a view where the layout allows (transposes
    # and head splits do), so the only copies are into `out` and jax's own buffer.
    lead, rest = index[:nl], index[nl:]
    ranges = [range(*sl.indices(n)) for sl, n in zip(lead, src.lead)]
    out = None
    for k, idx in enumerate(itertools.product(*ranges)):
      part = src.to_ours([reader.get(n) for n in src.names(idx)], block)[rest]
      if not nl:
        return np.asarray(part).astype(dtype, copy=False)
      if out is None:
        out = np.empty((math.prod(len(r) for r in ranges),) + part.shape, dtype)
      out[k] = part
    return out.reshape(tuple(len(r) for r in ranges) + out.shape[1:])

  return jax.make_array_from_callback(tuple(shape), sharding, callback)


def save_pretrained(model: Transformer, cfg: ModelConfig, path: str | os.PathLike, *,
                    layout: str = "kimi_linear", quantize_experts: bool = False,
                    max_shard_bytes: int = 2 << 30, extra_config: dict | None = None
                    ) -> list[str]:
  """Write `model` as a HF checkpoint: config.json, shards and model.safetensors.index.json.

  Args:
    layout: "kimi_linear" (transformers' KimiLinearForCausalLM names) or "kimi_k3"
      (`language_model.` prefix, composite config).
    quantize_experts: kimi_k3 only: routed experts as MXFP4 (weight_packed / weight_scale),
      as the K3 release stores them; lossy unless the weights came from MXFP4.
    max_shard_bytes: shard size budget.
    extra_config: keys added to the text config (e.g. `hf_config.token_ids(original)`).

  Returns:
    the shard file names. Tensors are gathered from the devices one at a time.

  Into an existing directory: its config.json is removed first and the new one written last
  (atomically), so a write that fails half-way leaves no loadable mix; shards of an earlier
  checkpoint that the new index does not list (and a `model.safetensors`) are removed; other
  files (e.g. tokenizer files) are kept.

  Raises:
    ValueError: a layout that cannot express cfg (hf_config.config_to_hf: named fields, e.g.
      quantize_experts with the kimi_linear layout, or an expert input dimension that is not a
      multiple of MXFP4's block of 32), before anything is written.
  """
  path = pathlib.Path(path)
  conf = hf_config.config_to_hf(cfg, layout, quantized=quantize_experts, extra=extra_config)
  begin_checkpoint(path)
  writer = ShardWriter(path, max_shard_bytes)
  flat = dict(nnx.to_flat_state(nnx.state(model)))
  try:
    for s in hf_names.sources(cfg, layout):
      arr = flat[s.path][...]
      for idx in itertools.product(*[range(n) for n in s.lead]):
        block = np.asarray(jax.device_get(arr[idx] if idx else arr))
        for name, t in zip(s.names(idx), s.to_hf(block)):
          if quantize_experts and _EXPERT.search(name):
            packed, scale = mxfp4.quantize(t.astype(np.float32))
            writer.add(name + "_packed", packed)
            writer.add(name + "_scale", scale)
          else:
            writer.add(name, t)
  except BaseException:
    writer.abort()
    raise
  files = writer.close()
  write_text_atomic(path / "config.json", json.dumps(conf, indent=2) + "\n")  # last: the commit
  return files


def begin_checkpoint(path: pathlib.Path) -> None:
  """Remove `path`'s config.json before a checkpoint is (re)written there: a write that stops
  half-way then leaves a directory that neither `load_pretrained` nor transformers loads
  ("no config.json"), not an earlier config.json over a mix of old and new files. The new
  config.json is written last."""
  (pathlib.Path(path) / "config.json").unlink(missing_ok=True)


# ------------------------------------------------------------------ CLI
def import_to_workdir(hf_dir, workdir_path, *, dtype: str | None = None,
                      ignore_keys: tuple[str, ...] = ()) -> pathlib.Path:
  """HF checkpoint `hf_dir` -> `<workdir>/hf_import/` (Orbax; see interop/workdir.py), with
  the checkpoint's tokenizer (tokenizer.json or tiktoken.model) when it ships one.
  `ignore_keys`: config.json keys to accept unmapped (load_pretrained).

  Raises:
    FileNotFoundError: no config.json in `hf_dir` (checked first: not an HF checkpoint).
    ValueError: `workdir_path` (or a directory above it) is a file; config.json is not JSON;
      the tokenizer has more ids than config.json's vocab_size, or its files are malformed
      (named); and load_pretrained's errors. Checked before the weights are read.
  """
  if not (pathlib.Path(hf_dir) / "config.json").is_file():
    raise FileNotFoundError(f"{hf_dir}: no config.json: give the directory of an HF "
                            "checkpoint (config.json, *.safetensors, the tokenizer files)")
  _check_directory(workdir_path, "workdir")
  raw = hf_config.read_config_json(hf_dir)
  tokenizer = workdir.checkpoint_tokenizer(hf_dir)
  model, cfg = load_pretrained(hf_dir, dtype=dtype, ignore_keys=tuple(ignore_keys))
  return workdir.save_import(model, cfg, raw, workdir_path, tokenizer=tokenizer)


def _check_directory(path, what: str) -> None:
  """Raise ValueError when `path` or the nearest existing directory above it is not a
  directory (the write would end in NotADirectoryError, after the model was read)."""
  p = pathlib.Path(path).absolute()
  for q in (p, *p.parents):
    if q.exists():
      if not q.is_dir():
        raise ValueError(f"{what} {path}: " + ("is a file" if q == p else f"{q} is a file")
                         + f": give a directory (new or existing) for the {what}")
      return


def _export_source(workdir_path: str, stage: str | None):
  """(model, cfg, token ids, tokenizer or None) of the stage checkpoint to export (with the
  tokenizer saved beside it), or of the HF import (with the tokenizer it recorded, if any)."""
  from sparse_lm.data import Tokenizer  # pylint: disable=g-import-not-at-top
  extra = workdir.token_ids(workdir_path)
  try:
    model, cfg, tokenizer = workdir.load_stage_with_tokenizer(workdir_path, stage)
  except FileNotFoundError:
    if stage is not None or workdir.imported_config(workdir_path) is None:
      raise
    model, cfg, _ = workdir.load_from_workdir(workdir_path)
    path = workdir.tokenizer_path(workdir_path)
    tokenizer = Tokenizer.load(path) if path else None
  return model, cfg, extra, tokenizer


def export_from_workdir(workdir_path, out, *, stage: str | None = None,
                        layout: str | None = None, quantize: bool = False) -> list[str]:
  """A workdir's newest trained stage (or `stage`; its HF import if it has no stage) -> HF
  checkpoint `out`: weights and config.json (`save_pretrained`) and the tokenizer files with
  the bos / eos / pad ids (`tokenizer_hf.write_checkpoint_files`), so that `import` of `out`
  gives the same model and tokenizer back. Returns the shard file names.

  `layout` None: `kimi_k3` with `quantize`, else `hf_config.default_layout` (`kimi_linear`
  when transformers' KimiLinearForCausalLM can hold the model, else `kimi_k3`).
  A SentencePiece tokenizer has no HF file to write: the weights are exported without it
  (with a warning). An existing `out` loses its earlier checkpoint files (config.json, shards,
  tokenizer.json / tiktoken.model / tokenizer_config.json), so nothing of an earlier export is
  read back with this one.

  Raises:
    FileNotFoundError: no checkpoint of `stage` (or of any stage, and no import).
    ValueError: `out` is "" (the current directory) or a file (or below one), checked first;
      `save_pretrained`'s errors: checked before anything is written to `out`.
  """
  from sparse_lm.data import tokenizer_hf  # pylint: disable=g-import-not-at-top
  if not str(out):  # pathlib.Path("") is ".": the current directory's files would be replaced
    raise ValueError("out is empty: give a directory for the HF checkpoint (new or existing; "
                     "its config.json, shards and tokenizer files are replaced)")
  _check_directory(out, "out")
  model, cfg, extra, tokenizer = _export_source(str(workdir_path), stage)
  if layout is None:
    layout = "kimi_k3" if quantize else hf_config.default_layout(cfg)
  hf_config.config_to_hf(cfg, layout, quantized=quantize)  # refuses before a file is written
  out = pathlib.Path(out)
  begin_checkpoint(out)
  for f in _TOKENIZER_FILES:  # an earlier export's (import reads tokenizer.json first)
    (out / f).unlink(missing_ok=True)
  if tokenizer is not None:
    try:
      extra = {**extra, **tokenizer_hf.write_checkpoint_files(tokenizer, out)}
    except ValueError as e:
      warnings.warn(f"{e}: exporting {out} without a tokenizer")
  return save_pretrained(model, cfg, out, layout=layout, quantize_experts=quantize,
                         extra_config=extra)


# The tokenizer files of an HF checkpoint that `import` reads (tokenizer.json before
# tiktoken.model): an export removes them from --out, then writes its own.
_TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m sparse_lm.interop.hf", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="cmd", required=True)
  a = sub.add_parser("import", help="HF checkpoint -> <workdir>/hf_import (Orbax)")
  a.add_argument("--hf-dir", "--hf_dir", dest="hf_dir", required=True)
  a.add_argument("--workdir", required=True)
  a.add_argument("--dtype", choices=("float32", "bfloat16"))
  a.add_argument("--ignore-keys", "--ignore_keys", dest="ignore_keys", default="",
                 metavar="KEY,KEY", help="config.json keys sparse_lm does not know, accepted "
                 "unmapped (only keys you know do not change the model, e.g. yarn_factor)")
  b = sub.add_parser("export", help="a workdir's newest trained stage (or its hf_import) -> "
                     "HF checkpoint")
  b.add_argument("--workdir", required=True)
  b.add_argument("--stage", help="the stage to export (default: the newest stage checkpoint "
                 "in the workdir; the HF import if there is none)")
  b.add_argument("--out", required=True)
  b.add_argument("--layout", choices=hf_config.LAYOUTS, default=None,
                 help="default: kimi_linear when transformers' KimiLinearForCausalLM can hold "
                      "the model (no SiTU, LatentMoE, MLA output gate or AttnRes), else kimi_k3")
  b.add_argument("--quantize", action="store_true", help="MXFP4 routed experts (kimi_k3)")
  args = ap.parse_args(argv)
  if args.cmd == "export" and args.quantize and args.layout == "kimi_linear":
    b.error("--quantize needs --layout kimi_k3 (Kimi-Linear stores bf16 experts)")
  if args.cmd == "export" and not args.out.strip():
    b.error(f"--out {args.out!r} is empty: give a directory for the HF checkpoint (an export "
            "replaces the config.json, shards and tokenizer files of the directory it is given)")
  if args.cmd == "export" and pathlib.Path(args.out).exists() and not pathlib.Path(
      args.out).is_dir():
    b.error(f"--out {args.out} is a file: give a directory (new or existing) for the HF "
            "checkpoint")
  try:  # a missing directory or a model the layout cannot hold: a message, status 2
    if args.cmd == "import":
      ignore = tuple(k.strip() for k in args.ignore_keys.split(",") if k.strip())
      out = import_to_workdir(args.hf_dir, args.workdir, dtype=args.dtype, ignore_keys=ignore)
      tok = workdir.tokenizer_path(args.workdir)
      print(f"imported {args.hf_dir} -> {out}" + (f" (tokenizer {tok})" if tok else
                                                   " (the checkpoint ships no tokenizer)"))
    else:
      files = export_from_workdir(args.workdir, args.out, stage=args.stage, layout=args.layout,
                                  quantize=args.quantize)
      conf = json.loads((pathlib.Path(args.out) / "config.json").read_text())
      tok = [f for f in ("tokenizer.json", "tiktoken.model")
             if (pathlib.Path(args.out) / f).is_file()]
      print(f"exported {len(files)} shard(s) to {args.out} ({conf['model_type']}); tokenizer: "
            + (tok[0] if tok else "none (the source has none)"))
  except (FileNotFoundError, ValueError) as e:
    (a if args.cmd == "import" else b).error(str(e))
  except OSError as e:  # a full disk, a read-only directory: one line, not a traceback
    message = write_failure(e, args.workdir if args.cmd == "import" else args.out)
    if message is None:
      raise
    (a if args.cmd == "import" else b).error(message)


if __name__ == "__main__":
  main()
