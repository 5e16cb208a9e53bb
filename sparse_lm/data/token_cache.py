"""Tokenizing a source's documents for the pipeline, with a per-process cache of the token arrays.

`Tokenize(source, tokenizer)` is the grain map `document index -> <bos> tokens <eos>`. The arrays
are kept (per source and tokenizer fingerprint) up to `TOKEN_CACHE_BYTES` per process, so that
later epochs and the eval pipelines at 1x and 2x length do not tokenize again; a source's arrays
are freed and un-counted when the source is garbage-collected.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from sparse_lm.data import sources
from sparse_lm.data.tokenizer import Tokenizer


# Tokenized documents are kept in memory (per source, per tokenizer) up to this many bytes per
# process, so later epochs and the eval pipelines at 1x and 2x length do not tokenize again.
# The whole standard library is ~30 MB of int32 tokens at a 512-id vocabulary.
TOKEN_CACHE_BYTES = 1 << 30
_cache_lock = threading.Lock()
_cache_bytes = 0


def _release(nbytes: int) -> None:
  global _cache_bytes
  with _cache_lock:
    _cache_bytes -= nbytes


class _TokenCache:
  """Token arrays of one source's documents; freed (and un-counted) with the source."""

  def __init__(self):
    self.arrays: dict[tuple[str, int], np.ndarray] = {}
    self.nbytes = [0]  # A list, so that the finalizer sees the final value.

  @classmethod
  def of(cls, source: sources.Source) -> _TokenCache:
    with _cache_lock:
      cache = getattr(source, "_token_cache", None)
      if cache is None:
        cache = source._token_cache = cls()  # pylint: disable=protected-access
        weakref.finalize(source, lambda n=cache.nbytes: _release(n[0]))
      return cache

  def put(self, key: tuple[str, int], tokens: np.ndarray) -> None:
    global _cache_bytes
    with _cache_lock:
      if key not in self.arrays and _cache_bytes + tokens.nbytes <= TOKEN_CACHE_BYTES:
        self.arrays[key] = tokens
        self.nbytes[0] += tokens.nbytes
        _cache_bytes += tokens.nbytes


class Tokenize:
  """Document index -> int32 array ``<bos> tokens <eos>`` (None for an empty document).

  The returned arrays may be shared through the cache: downstream steps must not modify them
  (chunking takes views, packing copies into its own buffers).
  """

  def __init__(self, source: sources.Source, tokenizer: Tokenizer):
    self._source = source
    self._tokenizer = tokenizer
    self._cache = _TokenCache.of(source)

  def __call__(self, index) -> np.ndarray | None:
    key = (self._tokenizer.fingerprint, int(index))
    out = self._cache.arrays.get(key)
    if out is None:
      text = self._source.load(int(index))
      if text is None:
        out = np.zeros(0, np.int32)
      else:
        ids = self._tokenizer.encode(text)
        out = np.empty(len(ids) + 2, np.int32)
        out[0], out[1:-1], out[-1] = self._tokenizer.bos_id, ids, self._tokenizer.eos_id
      out.flags.writeable = False
      self._cache.put(key, out)
    return out if out.size else None
