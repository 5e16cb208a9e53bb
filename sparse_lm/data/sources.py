"""Document sources: where the pretraining text comes from.

A source spec is a string (``DataConfig.source``):

  ``stdlib``              the ``.py`` files of the running Python's standard library (no
                          download); each file is a document, or with ``long_documents`` each
                          package directory (``asyncio/``, ``email/``, ...) is one document.
  ``text:PATH_OR_GLOB``   UTF-8 text files (a file, a directory searched recursively, or a glob);
                          each file is a document. Undecodable bytes are replaced and counted;
                          binary files (a NUL byte in the first 8 KiB) are skipped and counted.
  ``jsonl:PATH_OR_GLOB``  one JSON object per line, the document in field ``"text"``.
  ``parquet:PATH_OR_GLOB``  one document per row, column ``"text"``.
  ``arrayrecord:PATH_OR_GLOB``  one document per record: UTF-8 text, or JSON with ``"text"``.

Every document has a stable id (a path relative to the source root, plus a record number for
record formats). The held-out split is a function of that id alone (``is_eval_document``), so it
is the same on every host, in every run and in both the short- and long-document views: the long
view of ``stdlib`` groups files *after* splitting them, so a held-out file never appears inside a
training package document.

A ``Source`` is a random-access sequence of documents: ``len(source)``, ``source.doc_ids[i]`` and
``source.load(i) -> str | None`` (``None`` for an empty or unreadable document, which the pipeline
drops). Text is read lazily, in the pipeline's reader threads.

``sparse_lm.data.splits.open_split`` chooses how the held-out split is made: by whole documents
as above, or by the tail of every document (a one-file corpus).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import sysconfig
import threading
from collections.abc import Sequence

import numpy as np

_log = logging.getLogger(__name__)

SCHEMES = ("stdlib", "text", "jsonl", "parquet", "arrayrecord")
# A package directory larger than this is split (at file boundaries) into several long documents,
# so that no single document takes more than a few seconds to tokenize.
LONG_DOCUMENT_MAX_BYTES = 4 << 20
_BINARY_SNIFF_BYTES = 8192
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _stable_hash(doc_id: str) -> int:
  """A 64-bit hash of ``doc_id`` that is identical across processes, hosts and runs."""
  return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")


def is_eval_document(doc_id: str, eval_fraction: float) -> bool:
  """Whether a document belongs to the held-out split: ``hash(doc_id) mod 10000 < f * 10000``."""
  return _stable_hash(doc_id) % 10_000 < round(eval_fraction * 10_000)


@dataclasses.dataclass
class SourceStats:
  """Counters of what a source skipped or repaired (updated from reader threads)."""
  files: int = 0
  skipped_binary: int = 0
  skipped_binary_examples: list[str] = dataclasses.field(default_factory=list)
  repaired_files: int = 0
  replaced_chars: int = 0
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
  _repaired_ids: set[str] = dataclasses.field(default_factory=set, repr=False)

  def add_repaired(self, doc_id: str, replaced: int) -> None:
    """Counts a repaired file once, however often it is read (epochs, tokenizer sampling)."""
    with self._lock:
      if doc_id in self._repaired_ids:
        return
      self._repaired_ids.add(doc_id)
      self.repaired_files += 1
      self.replaced_chars += replaced
      count, total = self.repaired_files, self.replaced_chars
    if count <= 5 or count & (count - 1) == 0:
      _log.warning("%s: undecodable bytes replaced by U+FFFD (%d chars); %d file(s) repaired so "
                   "far, %d replacement chars in total", doc_id, replaced, count, total)


def decode_text(data: bytes, doc_id: str, stats: SourceStats) -> str:
  """UTF-8 decode ``data``; undecodable bytes are replaced with U+FFFD and counted."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    text = data.decode("utf-8", errors="replace")
    # Replacement chars that were not already in the input (a rare literal U+FFFD is UTF-8
    # encodable, so count the difference against the bytes' own occurrences).
    replaced = text.count("\ufffd") - data.count("\ufffd".encode("utf-8"))
    stats.add_repaired(doc_id, max(replaced, 1))
    return text


class Source:
  """A random-access sequence of documents (see the module docstring)."""

  name: str
  doc_ids: Sequence[str]
  num_bytes: int | None  # Size on disk when cheaply known (files), else None.
  stats: SourceStats

  def __len__(self) -> int:
    return len(self.doc_ids)

  def load(self, index: int) -> str | None:
    raise NotImplementedError


class FileSource(Source):
  """Documents made of whole files: one file each, or several files concatenated."""

  def __init__(self, name: str, root: str, groups: Sequence[tuple[str, tuple[str, ...]]],
               num_bytes: int, stats: SourceStats):
    self.name = name
    self._root = root
    self._groups = list(groups)
    self.doc_ids = [doc_id for doc_id, _ in self._groups]
    self.num_bytes = num_bytes
    self.stats = stats

  def member_files(self, index: int) -> tuple[str, ...]:
    """Paths (relative to the source root) of the files that make up document ``index``."""
    return self._groups[index][1]

  def load(self, index: int) -> str | None:
    parts = []
    for rel in self._groups[index][1]:
      with open(os.path.join(self._root, rel), "rb") as f:
        data = f.read()
      text = decode_text(data, rel, self.stats)
      if len(self._groups[index][1]) > 1:
        text = f"# file: {rel}\n{text}"
      parts.append(text)
    text = "\n".join(parts)
    return text if text.strip() else None


class JsonlSource(Source):
  """One document per line of JSON-lines files (field ``"text"``); lines indexed lazily."""

  def __init__(self, name: str, root: str, files: Sequence[str], eval_fraction: float,
               split: str):
    self.name = name
    self.stats = SourceStats(files=len(files))
    self._root = root
    self._paths = [os.path.join(root, rel) for rel in files]
    doc_ids, spans, num_bytes = [], [], 0
    for file_index, rel in enumerate(files):
      data = np.fromfile(self._paths[file_index], dtype=np.uint8)
      num_bytes += data.size
      ends = np.flatnonzero(data == ord("\n")) + 1
      starts = np.concatenate([[0], ends])
      ends = np.concatenate([ends, [data.size]])
      for line, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        if end - start <= 1:
          continue
        doc_id = f"{rel}:{line}"
        if (split == "eval") == is_eval_document(doc_id, eval_fraction):
          doc_ids.append(doc_id)
          spans.append((file_index, start, end))
    self.doc_ids = doc_ids
    self._spans = spans
    self.num_bytes = num_bytes

  def load(self, index: int) -> str | None:
    file_index, start, end = self._spans[index]
    with open(self._paths[file_index], "rb") as f:
      f.seek(start)
      raw = f.read(end - start)
    line = decode_text(raw, self.doc_ids[index], self.stats).strip()
    if not line:
      return None
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{self.doc_ids[index]}: not a JSON object ({e})") from e
    if not isinstance(record, dict) or "text" not in record:
      raise ValueError(f"{self.doc_ids[index]}: JSON record has no field 'text' "
                       f"(fields: {sorted(record) if isinstance(record, dict) else type(record)})")
    text = record["text"]
    return _document_text(text, self.doc_ids[index])


def _document_text(text, doc_id: str) -> str | None:
  """A record's "text" value as a document: None for null or whitespace only; ValueError
  naming `doc_id` for a value that is not a string (a number or list was dropped silently)."""
  if text is not None and not isinstance(text, str):
    raise ValueError(f"{doc_id}: JSON field 'text' is a {type(text).__name__} "
                     f"({str(text)[:40]!r}), not a string")
  return text if text is not None and text.strip() else None


class ParquetSource(Source):
  """One document per row of Parquet files (column ``"text"``), read one row group at a time."""

  def __init__(self, name: str, root: str, files: Sequence[str], eval_fraction: float,
               split: str):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    self.name = name
    self.stats = SourceStats(files=len(files))
    self._paths = [os.path.join(root, rel) for rel in files]
    doc_ids, locs, num_bytes = [], [], 0
    for file_index, rel in enumerate(files):
      meta = pq.ParquetFile(self._paths[file_index])
      if "text" not in meta.schema_arrow.names:
        raise ValueError(f"parquet file {self._paths[file_index]} has no column 'text' "
                         f"(columns: {meta.schema_arrow.names})")
      num_bytes += os.path.getsize(self._paths[file_index])
      row = 0
      for group in range(meta.metadata.num_row_groups):
        for offset in range(meta.metadata.row_group(group).num_rows):
          doc_id = f"{rel}:{row}"
          if (split == "eval") == is_eval_document(doc_id, eval_fraction):
            doc_ids.append(doc_id)
            locs.append((file_index, group, offset))
          row += 1
    self.doc_ids = doc_ids
    self._locs = locs
    self.num_bytes = num_bytes

  @functools.lru_cache(maxsize=8)
  def _row_group(self, file_index: int, group: int) -> list:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    table = pq.ParquetFile(self._paths[file_index]).read_row_group(group, columns=["text"])
    return table.column("text").to_pylist()

  def load(self, index: int) -> str | None:
    file_index, group, offset = self._locs[index]
    text = self._row_group(file_index, group)[offset]
    if isinstance(text, bytes):
      text = decode_text(text, self.doc_ids[index], self.stats)
    return text if isinstance(text, str) and text.strip() else None


class ArrayRecordSource(Source):
  """One document per ArrayRecord record: UTF-8 text, or a JSON object with ``"text"``."""

  def __init__(self, name: str, root: str, files: Sequence[str], eval_fraction: float,
               split: str):
    # pylint: disable=g-import-not-at-top
    from array_record.python import array_record_data_source, array_record_module
    # pylint: enable=g-import-not-at-top
    self.name = name
    self.stats = SourceStats(files=len(files))
    paths = [os.path.join(root, rel) for rel in files]
    self._reader = array_record_data_source.ArrayRecordDataSource(paths)
    doc_ids, keys, key = [], [], 0
    for rel, path in zip(files, paths):
      reader = array_record_module.ArrayRecordReader(path)
      count = reader.num_records()
      reader.close()
      for record in range(count):
        doc_id = f"{rel}:{record}"
        if (split == "eval") == is_eval_document(doc_id, eval_fraction):
          doc_ids.append(doc_id)
          keys.append(key)
        key += 1
    self.doc_ids = doc_ids
    self._keys = keys
    self.num_bytes = sum(os.path.getsize(p) for p in paths)

  def load(self, index: int) -> str | None:
    text = decode_text(self._reader[self._keys[index]], self.doc_ids[index], self.stats)
    if text.lstrip().startswith("{"):
      try:
        record = json.loads(text)
      except json.JSONDecodeError:
        record = None
      if isinstance(record, dict) and "text" in record:
        text = record["text"]
    return _document_text(text, self.doc_ids[index])


def _glob_files(scheme: str, pattern: str) -> tuple[str, list[str]]:
  """Resolves PATH_OR_GLOB to (root, sorted paths relative to root); raises if nothing matches."""
  expanded = os.path.abspath(os.path.expanduser(pattern))
  if os.path.isdir(expanded):
    root = expanded
    candidates = glob.glob(os.path.join(glob.escape(root), "**", "*"), recursive=True)
  elif glob.has_magic(expanded):
    # The root is the longest leading part of the pattern without wildcards.
    parts = expanded.split(os.sep)
    literal = []
    for part in parts:
      if glob.has_magic(part):
        break
      literal.append(part)
    root = os.sep.join(literal) or os.sep
    candidates = glob.glob(expanded, recursive=True)
  else:
    root = os.path.dirname(expanded)
    candidates = [expanded] if os.path.exists(expanded) else []
  files = sorted(os.path.relpath(p, root) for p in candidates if os.path.isfile(p))
  if not files:
    if os.path.isdir(root):
      listing = sorted(os.listdir(root))
      there = (f"the directory exists and holds {len(listing)} entries"
               + (f" (e.g. {', '.join(listing[:5])})" if listing else ""))
    else:
      there = "the directory does not exist"
    raise FileNotFoundError(
        f"data source '{scheme}:{pattern}': no files matched. Searched pattern {pattern!r} "
        f"(resolved to {expanded!r}) in directory {root!r}: {there}; 0 files matched. Fix: point "
        f"the source at an existing file, directory or glob (e.g. '{scheme}:/data/corpus/*."
        f"{'txt' if scheme == 'text' else scheme}'), or use the built-in source 'stdlib' "
        "which needs no download.")
  return root, files


def _sniff_binary(path: str) -> bool:
  with open(path, "rb") as f:
    return b"\x00" in f.read(_BINARY_SNIFF_BYTES)


def _file_documents(name: str, root: str, files: Sequence[str], *, long_documents: bool,
                    eval_fraction: float, split: str, stats: SourceStats) -> FileSource:
  """Splits files into train/eval by their relative path, then optionally groups them."""
  kept, num_bytes = [], 0
  for rel in files:
    path = os.path.join(root, rel)
    if _sniff_binary(path):
      stats.skipped_binary += 1
      if len(stats.skipped_binary_examples) < 5:
        stats.skipped_binary_examples.append(rel)
      continue
    if (split == "eval") == is_eval_document(rel, eval_fraction):
      size = os.path.getsize(path)
      kept.append((rel, size))
      num_bytes += size
  if stats.skipped_binary:
    _log.warning("data source %s: skipped %d binary file(s) (NUL bytes), e.g. %s; %d text "
                 "file(s) kept", name, stats.skipped_binary, stats.skipped_binary_examples,
                 len(files) - stats.skipped_binary)
  if not long_documents:
    groups = [(rel, (rel,)) for rel, _ in kept]
  else:
    # One document per top-level package directory; top-level modules form their own group.
    # Groups larger than LONG_DOCUMENT_MAX_BYTES are cut at file boundaries into parts.
    by_dir: dict[str, list[tuple[str, int]]] = {}
    for rel, size in kept:
      head = rel.split(os.sep, 1)[0] if os.sep in rel else "<top-level>"
      by_dir.setdefault(head, []).append((rel, size))
    groups = []
    for head in sorted(by_dir):
      part, part_files, part_bytes = 0, [], 0
      for rel, size in by_dir[head]:
        if part_files and part_bytes + size > LONG_DOCUMENT_MAX_BYTES:
          groups.append((f"{head}#{part}", tuple(part_files)))
          part, part_files, part_bytes = part + 1, [], 0
        part_files.append(rel)
        part_bytes += size
      if part_files:
        groups.append((f"{head}#{part}", tuple(part_files)))
  return FileSource(name, root, groups, num_bytes, stats)


def stdlib_files() -> tuple[str, list[str]]:
  """The running Python's standard-library ``.py`` files: (root, sorted relative paths)."""
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    for filename in filenames:
      if filename.endswith(".py"):
        files.append(os.path.relpath(os.path.join(dirpath, filename), root))
  if not files:
    raise FileNotFoundError(f"data source 'stdlib': no .py files found under {root!r} "
                            "(sysconfig.get_paths()['stdlib']); use 'text:PATH' instead.")
  return root, sorted(files)


def parse_source(spec: str) -> tuple[str, str]:
  """Splits ``scheme:path`` and checks the scheme; raises ValueError listing valid schemes."""
  if spec == "stdlib":
    return "stdlib", ""
  scheme, sep, path = spec.partition(":")
  if not sep or scheme not in SCHEMES or scheme == "stdlib":
    raise ValueError(
        f"DataConfig.source={spec!r}: unknown source. Valid sources: 'stdlib', "
        "'text:PATH_OR_GLOB', 'jsonl:PATH_OR_GLOB', 'parquet:PATH_OR_GLOB', "
        "'arrayrecord:PATH_OR_GLOB' "
        f"(schemes: {', '.join(SCHEMES)}).")
  if not path:
    raise ValueError(f"DataConfig.source={spec!r}: the {scheme!r} source needs a path, "
                     f"e.g. '{scheme}:/data/corpus'.")
  return scheme, path


def open_source(spec: str, *, split: str, eval_fraction: float,
                long_documents: bool = False) -> Source:
  """Opens the ``split`` ("train" or "eval") of the source ``spec``.

  Listing is cheap (paths, sizes, record offsets); text is read lazily by ``Source.load``.
  Cached per process, so the train and eval pipelines and ``describe`` share one listing; a
  file added, removed or changed (size or modification time) since makes a new listing (a
  notebook that edits its data and trains again read the old record offsets).

  Raises:
    ValueError: unknown scheme, bad split, or a malformed file (no 'text' field/column).
    FileNotFoundError: no file matches the path; the message lists what was searched.
  """
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  scheme, path = parse_source(spec)
  root, stamp = None, ()
  if scheme != "stdlib":
    root, files = _glob_files(scheme, path)
    stamp = tuple((f, st.st_size, st.st_mtime_ns) for f in files
                  for st in (os.stat(os.path.join(root, f)),))
  return _open_source(spec, split=split, eval_fraction=eval_fraction,
                      long_documents=long_documents, root=root, stamp=stamp)


@functools.lru_cache(maxsize=16)
def _open_source(spec: str, *, split: str, eval_fraction: float, long_documents: bool,
                 root: str | None, stamp: tuple) -> Source:
  """`open_source`'s listing of the files `stamp` names under `root` (the cache key: their
  names, sizes and mtimes)."""
  scheme, _ = parse_source(spec)
  if scheme == "stdlib":
    root, files = stdlib_files()
    stats = SourceStats(files=len(files))
    return _file_documents(spec, root, files, long_documents=long_documents,
                           eval_fraction=eval_fraction, split=split, stats=stats)
  files = [f for f, _, _ in stamp]
  if scheme == "text":
    stats = SourceStats(files=len(files))
    return _file_documents(spec, root, files, long_documents=False,
                           eval_fraction=eval_fraction, split=split, stats=stats)
  cls = {"jsonl": JsonlSource, "parquet": ParquetSource, "arrayrecord": ArrayRecordSource}[scheme]
  return cls(spec, root, files, eval_fraction, split)
