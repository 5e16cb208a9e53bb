"""Shared fixtures for the data tests: small random corpora and a tokenizer trained on one."""

import pytest

from data_testing import random_documents, write_text_corpus
from sparse_lm.data import DataConfig, load_or_train_tokenizer


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
  """(directory, documents) of 120 random text files."""
  docs = random_documents(120, seed=1234)
  return write_text_corpus(tmp_path_factory.mktemp("corpus"), docs), docs


@pytest.fixture(scope="session")
def corpus_tokenizer(corpus, tmp_path_factory):
  """A 300-id byte-level BPE trained on ``corpus``."""
  cfg = DataConfig(source=f"text:{corpus[0]}")
  return load_or_train_tokenizer(cfg, str(tmp_path_factory.mktemp("tok")), vocab_size=300)


@pytest.fixture(scope="session")
def stdlib_tokenizer(tmp_path_factory):
  """The default configuration's tokenizer (a 512-id BPE trained on the standard library)."""
  return load_or_train_tokenizer(DataConfig(), str(tmp_path_factory.mktemp("stdlib_tok")),
                                 vocab_size=512)
