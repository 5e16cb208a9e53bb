"""Helpers for the data tests: random corpora and document markers."""

import os
import re

import numpy as np

_MARKER = re.compile(r"doc(\d{4}) ")


def random_documents(num_docs: int, seed: int, *, max_words: int = 300) -> list[str]:
  """Documents ``"docNNNN <random words and lines>"`` of widely varying length."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz_"))
  lexicon = ["".join(rng.choice(letters, rng.integers(1, 9))) for _ in range(400)]
  docs = []
  for i in range(num_docs):
    n = int(rng.integers(2, max_words))
    words = rng.choice(lexicon, n)
    breaks = rng.random(n) < 0.1
    body = "".join(w + ("\n" if b else " ") for w, b in zip(words, breaks))
    docs.append(f"doc{i:04d} {body}")
  return docs


def write_text_corpus(directory, docs) -> str:
  os.makedirs(directory, exist_ok=True)
  for i, text in enumerate(docs):
    with open(os.path.join(directory, f"d{i:04d}.txt"), "w", encoding="utf-8") as f:
      f.write(text)
  return str(directory)


def doc_marker(text: str) -> int | None:
  m = _MARKER.match(text)
  return int(m.group(1)) if m else None
