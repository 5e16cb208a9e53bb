"""Shared fixtures for the vision tests."""

import pytest

from sparse_lm.data import DataConfig, load_or_train_tokenizer


@pytest.fixture(scope="session")
def stdlib_tok(tmp_path_factory):
  """A 300-id byte-level BPE trained on a few small text files (seconds)."""
  root = tmp_path_factory.mktemp("tok_corpus")
  words = ["image", "caption", "digit", "seven", "cat", "dog", "logo", "gray", "palette",
           "alpha", "noise", "print", "return", "lambda"]
  for i in range(8):
    (root / f"d{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(200)))
  return load_or_train_tokenizer(DataConfig(source=f"text:{root}"),
                                 str(tmp_path_factory.mktemp("tok")), vocab_size=300)
