"""Grain input pipeline: documents -> tokens -> packed rows -> per-host batches.

Training stream, per host (``process_index`` of ``process_count``)::

  train-split document indices [process_index::process_count]   disjoint across hosts
    -> shuffle(seed), reshuffled every epoch; repeat(num_epochs)  grain.MapDataset
    -> load + tokenize: <bos> text <eos> as int32                reader threads, lazily;
                                                                 kept in memory (1 GiB budget; token_cache.py)
    -> split into chunks of at most seq_len tokens               grain FlatMap
    -> first-fit / best-fit packing into rows of seq_len,        grain.experimental packing
       the rows of each pack emitted in a seeded random order
    -> optionally, rows shuffled in windows of shuffle_window    grain WindowShuffleIterDataset
    -> batch(batch_size) -> numpy dict -> thread prefetch

Each batch is a dict of numpy arrays, ``b = batch_size`` rows of ``T = seq_len`` tokens:

  tokens       int32   [b, T]  token ids; 0 (= <pad>) in padding
  segment_ids  int32   [b, T]  1, 2, ... for the documents (chunks) packed in a row; 0 = padding
  positions    int32   [b, T]  position of the token within its document (a chunk of a long
                               document continues from where the previous chunk stopped); 0 in
                               padding
  loss_mask    float32 [b, T]  1.0 on real tokens, 0.0 on padding

Next-token targets are the caller's business: within a segment, ``tokens[t + 1]`` follows
``tokens[t]``; the model must not attend or carry state across segment boundaries.

The iterator is a ``grain.DatasetIterator``: ``get_state()`` returns a small JSON-serializable
dict, and ``set_state(state)`` on a fresh iterator built with the same arguments continues with
exactly the batches the original would have produced (packing is replayed from the start of the
last emitted pack, so the state stays small). The state records the pipeline's settings, and a
state from other settings is refused rather than silently feeding different data.

The held-out split (``make_eval_batches``) is read in document order without bin shuffling, so
its batches are the same for every seed and host.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any

import grain
import numpy as np
from grain import experimental as grain_exp

from sparse_lm.data import image_pipeline, images, sources, splits
from sparse_lm.data.token_cache import Tokenize
from sparse_lm.data.tokenizer import SPECIAL_TOKENS, Tokenizer

_log = logging.getLogger(__name__)

PACKING = ("first_fit", "best_fit")
IMAGE_TOKEN_ID = SPECIAL_TOKENS.index("<image>")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to batch it.

  Attributes:
    source: ``stdlib`` (default), ``text:PATH_OR_GLOB``, ``jsonl:...``, ``parquet:...`` or
      ``arrayrecord:...`` (see ``sparse_lm.data.sources``).
    long_documents: the long-document view (``stdlib``: one document per package directory),
      for the 64K+ stages.
    eval_fraction: fraction of the data held out (0: no held-out split, no evaluation).
    eval_split: how it is held out: "documents" (whole documents, chosen by a hash of the
      id), "tail" (the last eval_fraction of every document; a one-file corpus) or "auto"
      (documents when both splits get one, else tail).
    packing: ``first_fit`` or ``best_fit``.
    shuffle_window: packed training rows are shuffled in consecutive windows of this many rows
      before batching (0 = off, rows in packing order). Without it a document of n tokens
      fills about n / seq_len consecutive rows, so a small batch holds one or two documents;
      a window spanning many documents makes each batch a mix of them (as a large global batch
      is). Costs window x seq_len x 12 bytes of memory and a refill pause every window rows.
    seed: shuffling and bin-order seed.
    tokenizer: path to a ``tokenizer.json`` or SentencePiece ``.model``, or ``hf:DIR`` for
      the tokenizer shipped with the HF checkpoint DIR (``tokenizer.json`` or ``tiktoken.model``,
      ``sparse_lm.data.tokenizer_hf``); None trains a byte-level BPE on the source and caches
      it in the run directory.
    prefetch: batches prepared ahead in a background thread (0 = none).
    images: image-caption sources mixed into the stream (``sparse_lm.data.image_sources``,
      e.g. ``digits+words`` or ``imagefolder:PATH``); "" = text only.
    image_ratio: fraction of the packed elements that are image-caption examples (the others
      are text chunks of up to seq_len tokens, so the token share of images is smaller).
    image_max_side: images with a longer side (pixels) are downscaled, with a warning.
    image_patches_per_row: encoder patch slots per packed row, L (0 = seq_len); batches then
      carry ``image_patches`` uint8 [b, L, p*p*3], ``image_segment_ids`` int32 [b, L] and
      ``image_coords`` int32 [b, L, 2] (``sparse_lm.data.images``).
  """
  source: str = "stdlib"
  long_documents: bool = False
  eval_fraction: float = 0.02
  eval_split: str = "auto"
  packing: str = "first_fit"
  shuffle_window: int = 0
  seed: int = 0
  tokenizer: str | None = None
  prefetch: int = 2
  images: str = ""
  image_ratio: float = 0.0
  image_max_side: int = 1024
  image_patches_per_row: int = 0

  def __post_init__(self):
    if not isinstance(self.source, str) or not self.source:
      raise ValueError(f"DataConfig.source must be a non-empty string, got {self.source!r}")
    sources.parse_source(self.source)
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ValueError(f"DataConfig.eval_fraction must be in [0, 1), got {self.eval_fraction}")
    if self.eval_split not in splits.EVAL_SPLITS:
      raise ValueError(f"DataConfig.eval_split must be one of {splits.EVAL_SPLITS}, got "
                       f"{self.eval_split!r}")
    if self.packing not in PACKING:
      raise ValueError(f"DataConfig.packing must be one of {PACKING}, got {self.packing!r}")
    if not isinstance(self.shuffle_window, int) or self.shuffle_window < 0:
      raise ValueError(f"DataConfig.shuffle_window must be an int >= 0 (rows; 0 = off), got "
                       f"{self.shuffle_window!r}")
    if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
      raise ValueError(f"DataConfig.seed must be an int in [0, 2**32), got {self.seed!r}")
    if not isinstance(self.prefetch, int) or self.prefetch < 0:
      raise ValueError(f"DataConfig.prefetch must be an int >= 0, got {self.prefetch!r}")
    if self.images:
      from sparse_lm.data import image_sources
      image_sources.check_spec(self.images)
    if not 0.0 <= self.image_ratio <= 1.0 or (self.images and self.image_ratio == 0.0):
      raise ValueError(f"DataConfig.image_ratio={self.image_ratio} must be in [0, 1] (and > 0 "
                       "when DataConfig.images is set)")
    if self.image_max_side < 28 or self.image_patches_per_row < 0:
      raise ValueError("DataConfig.image_max_side must be >= 28 px and image_patches_per_row "
                       ">= 0 (0 = seq_len)")
    if self.tokenizer is not None and not isinstance(self.tokenizer, str):
      raise ValueError(f"DataConfig.tokenizer must be a path or None, got {self.tokenizer!r}")


def _open(data_cfg: DataConfig, split: str) -> sources.Source:
  source = splits.open_split(data_cfg.source, split=split,
                              eval_fraction=data_cfg.eval_fraction,
                              long_documents=data_cfg.long_documents,
                              eval_split=data_cfg.eval_split)
  if len(source) == 0:
    stats = source.stats
    raise ValueError(
        f"data source {data_cfg.source!r} has no {split} documents ({stats.files} files, "
        f"{stats.skipped_binary} skipped as binary, eval_fraction={data_cfg.eval_fraction}, "
        f"held out by {source.split_by}). "
        + ("Add documents (text files, or a jsonl/parquet source)."
           if split == "train" and source.split_by != "documents" else
           "Set data.eval_split=tail to hold out the tail of every document, or "
           "data.eval_fraction=0 to train without a held-out split."))
  if split == "train" and not any((text := source.load(i)) and text.strip()
                                  for i in range(len(source))):
    # Documents but no text: the packer would wait for its first token forever (a run that
    # hangs, and SIGTERM waits for a step that never ends).
    raise ValueError(
        f"data source {data_cfg.source!r}: its {len(source)} training document(s) hold no text "
        "(empty or whitespace only). Point data.source at files with text.")
  return source


class _Chunk(grain_exp.FlatMapTransform):
  """Token array -> chunks of at most ``seq_len`` tokens, with their in-document positions."""

  max_fan_out = 1 << 30  # Unused by the iterator flat map; documents may be arbitrarily long.

  def __init__(self, seq_len: int):
    self._seq_len = seq_len

  def flat_map(self, element: np.ndarray) -> list[dict[str, np.ndarray]]:
    positions = np.arange(len(element), dtype=np.int32)
    t = self._seq_len
    return [{"tokens": element[s:s + t], "doc_positions": positions[s:s + t]}
            for s in range(0, len(element), t)]


def _finalize(rows: dict[str, np.ndarray], batch_size: int | None = None) -> dict[str, np.ndarray]:
  segment_ids = rows["tokens_segment_ids"].astype(np.int32)
  batch = {
      "tokens": rows["tokens"].astype(np.int32),
      "segment_ids": segment_ids,
      "positions": rows["doc_positions"].astype(np.int32),
      "loss_mask": (segment_ids > 0).astype(np.float32),
  }
  if "patches" in rows:  # image-text rows: no loss on <image> positions
    batch["loss_mask"] = images.image_loss_mask(batch["tokens"], batch["loss_mask"],
                                                IMAGE_TOKEN_ID)
    batch.update(images.finalize_rows(rows, IMAGE_TOKEN_ID))
  if batch_size is not None and segment_ids.shape[0] < batch_size:
    pad = batch_size - segment_ids.shape[0]
    batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
             for k, v in batch.items()}
  return batch


class _PrefetchIterator(grain_exp.ThreadPrefetchDatasetIterator):
  """Grain's thread-prefetch iterator, minus its noisy ``__del__`` at interpreter exit (it
  touches module globals that are already gone)."""

  def __del__(self, _is_finalizing=sys.is_finalizing):
    if not _is_finalizing():
      super().__del__()


class _Prefetch(grain_exp.ThreadPrefetchIterDataset):

  def __init__(self, parent: grain.IterDataset, prefetch: int):
    super().__init__(parent, prefetch_buffer_size=prefetch)
    self._prefetch = prefetch

  def __iter__(self) -> grain.DatasetIterator:
    return _PrefetchIterator(self._parent.__iter__(), self._prefetch)


class PipelineChangedError(ValueError):
  """A saved data-iterator state comes from a pipeline with other settings (source, seed,
  batch, length, shard, tokenizer): restoring it would not reproduce the saved run's data."""


# Signature keys added since states were first saved, with the value they implicitly had.
_BEFORE_KEY = {"eval_split": "documents", "shuffle_window": 0}


class _TrainIterator(grain.DatasetIterator):
  """The training iterator: Grain's, with its state tagged by what produced it.

  ``set_state`` refuses a state from a pipeline with another source, seed, shape, shard or
  tokenizer: restoring it would silently feed different data, not resume.
  """

  def __init__(self, parent: grain.DatasetIterator, signature: dict[str, Any]):
    super().__init__(parent)
    self._signature = signature

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return {"pipeline": dict(self._signature), "grain": self._parent.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or "grain" not in state or "pipeline" not in state:
      got = sorted(state) if isinstance(state, dict) else repr(state)
      raise ValueError("not a data-iterator state from make_train_iterator (expected keys "
                       f"'pipeline' and 'grain', got {got})")
    saved = state["pipeline"]
    diff = {k: (saved.get(k), v) for k, v in self._signature.items()
            if saved.get(k) != v and not (k not in saved and _BEFORE_KEY.get(k) == v)}
    if diff:
      raise PipelineChangedError(
          "the saved data-iterator state comes from a different input pipeline, so resuming "
          "would not reproduce its data; differing settings (saved, now): "
          + ", ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in sorted(diff.items())))
    self._parent.set_state(state["grain"])

  def close(self) -> None:
    self._parent.close()

  def __del__(self, _is_finalizing=sys.is_finalizing):
    if not _is_finalizing():
      super().__del__()


def _num_bins(seq_len: int, batch_size: int) -> int:
  # More bins pack tighter; bound the packing buffers to ~8M tokens per feature.
  return max(batch_size, min(16, max(1, (1 << 23) // seq_len)))


def _packed_rows(ds: grain.IterDataset, data_cfg: DataConfig, seq_len: int, num_bins: int,
                 shuffle_bins: bool, mix=None) -> grain.IterDataset:
  ds = grain_exp.FlatMapIterDataset(ds, _Chunk(seq_len))
  lengths = {"tokens": seq_len, "doc_positions": seq_len}
  if data_cfg.images:  # image-caption examples mixed in (data/image_pipeline.py)
    ds = mix(ds)
    lengths = image_pipeline.length_struct(data_cfg, seq_len)
  pack_cls = {"first_fit": grain_exp.FirstFitPackIterDataset,
              "best_fit": grain_exp.BestFitPackIterDataset}[data_cfg.packing]
  return pack_cls(ds, length_struct=lengths,
                  num_packing_bins=num_bins, seed=data_cfg.seed, shuffle_bins=shuffle_bins)


def _read_options(long_documents: bool) -> grain.ReadOptions:
  """Reader threads for loading + tokenizing documents (encode_batch releases the GIL).

  Long documents are each split into many pieces that the tokenizer encodes in parallel
  itself, so one reader thread with a short read-ahead gives the quickest first batch; short
  documents are spread over several threads.
  """
  if long_documents:
    return grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
  threads = max(1, min(8, os.cpu_count() or 1))
  return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * threads)


def _check_shape_args(seq_len: int, batch_size: int) -> None:
  if not isinstance(seq_len, int) or seq_len < 2:
    raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")


def make_train_iterator(data_cfg: DataConfig, tokenizer: Tokenizer, *, seq_len: int,
                        batch_size: int, process_index: int = 0, process_count: int = 1,
                        num_epochs: int | None = None, patch_size: int = 14
                        ) -> grain.DatasetIterator:
  """This host's stream of packed training batches (see the module docstring for the fields).

  Args:
    data_cfg: the data config.
    tokenizer: from ``load_or_train_tokenizer``.
    seq_len: tokens per row, T.
    batch_size: rows per batch on this host, b.
    process_index, process_count: this host's shard; hosts read disjoint documents.
    num_epochs: passes over this host's documents; None repeats forever (reshuffled each epoch).
    patch_size: the vision encoder's patch (``ModelConfig.vision_patch_size``), used when
      ``data_cfg.images`` mixes in image-caption examples.

  Returns:
    A ``grain.DatasetIterator`` with ``get_state()`` / ``set_state(state)``, yielding dicts of
    ``tokens``/``segment_ids``/``positions`` int32 [b, T] and ``loss_mask`` float32 [b, T].
    Deterministic given ``data_cfg.seed``; with finite ``num_epochs`` a last partial batch is
    dropped. The state is a small JSON-compatible dict (after ``state_to_json_compatible``)
    that records the pipeline settings; ``set_state`` raises ValueError for a state from a
    pipeline with other settings (source, seed, shapes, shard, tokenizer).

  Raises:
    ValueError: bad shapes or shard, or a split with no documents (or fewer than hosts).
    FileNotFoundError: the source path matches no file (the message lists what was searched).
  """
  _check_shape_args(seq_len, batch_size)
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
  source = _open(data_cfg, "train")
  shard = np.arange(len(source), dtype=np.int64)[process_index::process_count]
  if shard.size == 0:
    raise ValueError(f"data source {data_cfg.source!r} has {len(source)} training documents, "
                     f"fewer than process_count={process_count}; every host needs one")
  ds = grain.MapDataset.source(shard).shuffle(seed=data_cfg.seed).repeat(num_epochs)
  read = _read_options(data_cfg.long_documents)
  ds = ds.map(Tokenize(source, tokenizer)).to_iter_dataset(read)
  mix = lambda chunks: image_pipeline.mix_images(
      chunks, data_cfg, tokenizer, split="train", seq_len=seq_len, patch_size=patch_size,
      read_options=read, shard=(process_index, process_count), num_epochs=num_epochs)
  ds = _packed_rows(ds, data_cfg, seq_len, _num_bins(seq_len, batch_size), shuffle_bins=True,
                    mix=mix)
  if data_cfg.shuffle_window:
    ds = grain_exp.WindowShuffleIterDataset(ds, window_size=data_cfg.shuffle_window,
                                            seed=data_cfg.seed)
  ds = ds.batch(batch_size, drop_remainder=True).map(_finalize)
  if data_cfg.prefetch:
    ds = _Prefetch(ds, data_cfg.prefetch)
  signature = {"source": data_cfg.source, "long_documents": data_cfg.long_documents,
               "eval_fraction": data_cfg.eval_fraction, "eval_split": source.split_by,
               "packing": data_cfg.packing, "shuffle_window": data_cfg.shuffle_window,
               "seed": data_cfg.seed, "tokenizer": tokenizer.fingerprint, "seq_len": seq_len,
               "batch_size": batch_size, "process_index": process_index,
               "process_count": process_count, "num_epochs": num_epochs}
  if data_cfg.images:
    signature.update(images=data_cfg.images, image_ratio=data_cfg.image_ratio,
                     image_max_side=data_cfg.image_max_side, patch_size=patch_size,
                     image_patches_per_row=data_cfg.image_patches_per_row)
  return _TrainIterator(iter(ds), signature)


def make_eval_batches(data_cfg: DataConfig, tokenizer: Tokenizer, *, seq_len: int,
                      batch_size: int, num_batches: int, patch_size: int = 14
                      ) -> list[dict[str, np.ndarray]]:
  """The first ``num_batches`` batches of the held-out split, in a fixed order.

  Same fields and shapes as ``make_train_iterator``. Documents are read in id order and packed
  without bin shuffling, so the batches depend only on the source, tokenizer and shapes (not on
  the seed or the host). If the held-out split runs out, fewer batches are returned (a warning is
  logged) and the last one is padded with empty rows (``loss_mask`` 0).

  Raises:
    ValueError: bad shapes, ``num_batches`` < 1, or an empty held-out split.
  """
  _check_shape_args(seq_len, batch_size)
  if num_batches < 1:
    raise ValueError(f"num_batches must be >= 1, got {num_batches}")
  if data_cfg.eval_fraction <= 0:
    return []  # no held-out split
  source = _open(data_cfg, "eval")
  ds = grain.MapDataset.source(np.arange(len(source), dtype=np.int64))
  read = _read_options(data_cfg.long_documents)
  ds = ds.map(Tokenize(source, tokenizer)).to_iter_dataset(read)
  mix = lambda chunks: image_pipeline.mix_images(
      chunks, data_cfg, tokenizer, split="eval", seq_len=seq_len, patch_size=patch_size,
      read_options=read, shuffle=False)
  ds = _packed_rows(ds, data_cfg, seq_len, _num_bins(seq_len, batch_size), shuffle_bins=False,
                    mix=mix)
  batches = []
  for rows in ds.batch(batch_size):
    batches.append(_finalize(rows, batch_size))
    if len(batches) == num_batches:
      break
  if len(batches) < num_batches:
    _log.warning("held-out split of %s has only %d batches of %dx%d tokens (asked for %d): "
                 "its text runs out; give more text or raise data.eval_fraction",
                 data_cfg.source, len(batches), batch_size, seq_len, num_batches)
  return batches


def describe(data_cfg: DataConfig) -> str:
  """One line for the run log: source, documents and bytes per split, skipped/repaired files."""
  train = _open(data_cfg, "train")
  held_out = splits.open_split(data_cfg.source, split="eval",
                                eval_fraction=data_cfg.eval_fraction,
                                long_documents=data_cfg.long_documents,
                                eval_split=data_cfg.eval_split)

  def size(s: sources.Source) -> str:
    return "?" if s.num_bytes is None else f"{s.num_bytes / 1e6:.1f} MB"

  if train.split_by == "none":
    sizes = f"{len(train)} docs / {size(train)}, no held-out split"
  elif isinstance(train, (sources.FileSource, splits.TailSplit)):
    sizes = f"train {len(train)} docs / {size(train)}, eval {len(held_out)} docs / {size(held_out)}"
  else:
    sizes = f"train {len(train)} docs, eval {len(held_out)} docs, {size(train)} of files"
  skipped = train.stats.skipped_binary
  repaired = train.stats.repaired_files + (0 if held_out.stats is train.stats
                                           else held_out.stats.repaired_files)
  held = ("" if train.split_by == "none" else
          f"; held-out fraction {data_cfg.eval_fraction} by {train.split_by}")
  return (f"data: {data_cfg.source}{' (long documents)' if data_cfg.long_documents else ''}: "
          f"{sizes}{held}; packing {data_cfg.packing}"
          + (f"; skipped {skipped} binary file(s)" if skipped else "")
          + (f"; repaired {repaired} non-UTF-8 file(s) so far" if repaired else ""))


def time_to_first_batch(data_cfg: DataConfig, tokenizer: Tokenizer, *, seq_len: int,
                        batch_size: int) -> float:
  """Seconds from building the training iterator to holding its first batch."""
  start = time.perf_counter()
  it = make_train_iterator(data_cfg, tokenizer, seq_len=seq_len, batch_size=batch_size)
  next(it)
  elapsed = time.perf_counter() - start
  it.close()
  return elapsed


def state_to_json_compatible(state: Any) -> Any:
  """Converts numpy scalars in an iterator state to Python ints (for JSON checkpoints)."""
  if isinstance(state, dict):
    return {k: state_to_json_compatible(v) for k, v in state.items()}
  if isinstance(state, (list, tuple)):
    return type(state)(state_to_json_compatible(v) for v in state)
  if isinstance(state, np.generic):
    return state.item()
  return state
