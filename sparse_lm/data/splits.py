"""The held-out split of a source, as ``DataConfig.eval_split`` chooses.

  documents  whole documents, chosen by a hash of their id (``sources.is_eval_document``);
  tail       the tail of every document: its last ``eval_fraction`` of characters, cut at the
             first line break after that point, which a one-file corpus (nanoGPT's
             ``input.txt``) needs;
  auto       (default) documents when both splits get at least one, else tail.

``eval_fraction=0`` means no held-out split: every document trains, the eval split is empty.
"""

from __future__ import annotations

import functools

from sparse_lm.data.sources import Source, open_source

EVAL_SPLITS = ("auto", "documents", "tail")


class TailSplit(Source):
  """The head (train) or tail (eval) of every document of `whole`: the cut is at the first
  line break after `1 - eval_fraction` of its characters (at that character if none)."""

  def __init__(self, whole: Source, split: str, eval_fraction: float):
    self.name = whole.name
    self._whole, self._split, self._fraction = whole, split, eval_fraction
    self.doc_ids = [f"{d}#{split}" for d in whole.doc_ids]
    part = (1 - eval_fraction) if split == "train" else eval_fraction
    self.num_bytes = None if whole.num_bytes is None else int(whole.num_bytes * part)
    self.stats = whole.stats

  def load(self, index: int) -> str | None:
    text = self._whole.load(index)
    if text is None:
      return None
    cut = int(len(text) * (1 - self._fraction))
    newline = text.find("\n", cut)
    cut = newline + 1 if newline >= 0 else cut
    part = text[:cut] if self._split == "train" else text[cut:]
    return part if part.strip() else None


class _NoDocuments(Source):
  """The eval split when there is none (eval_fraction=0)."""

  def __init__(self, whole: Source):
    self.name, self.doc_ids, self.num_bytes, self.stats = whole.name, [], 0, whole.stats

  def load(self, index: int) -> str | None:
    raise IndexError(index)


@functools.lru_cache(maxsize=16)
def open_split(spec: str, *, split: str, eval_fraction: float, long_documents: bool = False,
               eval_split: str = "auto") -> Source:
  """The ``split`` ("train" or "eval") of source ``spec``, held out as ``eval_split`` says
  (module docstring); the returned source's ``split_by`` is "documents", "tail" or "none".

  Raises:
    ValueError: an unknown ``eval_split`` (and what ``open_source`` raises).
  """
  if eval_split not in EVAL_SPLITS:
    raise ValueError(f"DataConfig.eval_split={eval_split!r}: choose one of {EVAL_SPLITS}")
  if eval_fraction <= 0:
    whole = open_source(spec, split="train", eval_fraction=0.0, long_documents=long_documents)
    out = whole if split == "train" else _NoDocuments(whole)
    by = "none"
  elif eval_split != "tail" and _documents_split_works(spec, eval_fraction, long_documents,
                                                       eval_split):
    out = open_source(spec, split=split, eval_fraction=eval_fraction,
                      long_documents=long_documents)
    by = "documents"
  else:
    whole = open_source(spec, split="train", eval_fraction=0.0, long_documents=long_documents)
    out, by = TailSplit(whole, split, eval_fraction), "tail"
  out.split_by = by
  return out


def _documents_split_works(spec, eval_fraction, long_documents, eval_split) -> bool:
  if eval_split == "documents":
    return True
  return all(len(open_source(spec, split=s, eval_fraction=eval_fraction,
                             long_documents=long_documents)) for s in ("train", "eval"))
