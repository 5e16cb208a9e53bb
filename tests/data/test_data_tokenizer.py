"""Tokenizer: reserved special tokens, round trips, caching, fingerprints, given models."""

import io
import os
import re

import numpy as np
import pytest

from data_testing import random_documents
from sparse_lm.data import SPECIAL_TOKENS, DataConfig, Tokenizer, load_or_train_tokenizer
from sparse_lm.data import tokenizer as tokenizer_lib


def test_special_token_ids_are_fixed_and_pad_is_zero(corpus_tokenizer):
  tok = corpus_tokenizer
  assert SPECIAL_TOKENS == ("<pad>", "<bos>", "<eos>", "<image>", "<tool_call>", "</tool_call>",
                            "<tool_result>", "</tool_result>")
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.image_id, tok.tool_call_id,
          tok.tool_call_end_id, tok.tool_result_id, tok.tool_result_end_id) == tuple(range(8))
  assert tok.vocab_size == 300


def test_round_trip_and_special_strings_in_text_stay_text(corpus_tokenizer):
  tok = corpus_tokenizer
  rng = np.random.default_rng(0)
  alphabet = list("abc xyz\n\t{}()<>/_-=+*#'\"") + ["\u00e9", "\u4e2d", "\U0001F600", "\u0394"]
  for _ in range(20):
    text = "".join(rng.choice(alphabet, rng.integers(0, 200)))
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
  text = "call <tool_call>f(x)</tool_call> then <eos> and <pad>"
  plain = tok.encode(text)
  assert not set(plain) & set(range(len(SPECIAL_TOKENS)))
  assert tok.decode(plain) == text
  special = tok.encode(text, allow_special=True)
  assert tok.tool_call_id in special and tok.tool_call_end_id in special
  assert tok.eos_id in special and tok.pad_id in special
  assert tok.decode(special) == text
  assert tok.decode(special, skip_special=True) == "call f(x) then  and "


def test_cache_is_reused_and_fingerprint_is_stable(corpus, tmp_path, monkeypatch):
  cfg = DataConfig(source=f"text:{corpus[0]}")
  workdir = str(tmp_path / "run")
  first = load_or_train_tokenizer(cfg, workdir, vocab_size=300)
  cache = os.path.join(workdir, "tokenizer.json")
  assert os.path.isfile(cache)
  mtime = os.stat(cache).st_mtime_ns

  def no_training(*args, **kwargs):
    raise AssertionError("the cached tokenizer should have been reused")

  monkeypatch.setattr(tokenizer_lib, "train_bpe", no_training)
  second = load_or_train_tokenizer(cfg, workdir, vocab_size=300)
  assert os.stat(cache).st_mtime_ns == mtime
  assert second.fingerprint == first.fingerprint and len(first.fingerprint) == 16
  assert Tokenizer.from_json(first.to_json()).fingerprint == first.fingerprint
  text = corpus[1][0]
  assert second.encode(text) == first.encode(text)
  # A cached tokenizer larger than the model's vocabulary is an error, not a silent mismatch.
  with pytest.raises(ValueError, match="vocab_size is 280"):
    load_or_train_tokenizer(cfg, workdir, vocab_size=280)
  # Given explicitly (DataConfig.tokenizer), the path wins over the workdir.
  given = DataConfig(source=cfg.source, tokenizer=cache)
  assert load_or_train_tokenizer(given, str(tmp_path / "other"), 300).fingerprint == (
      first.fingerprint)


def test_training_is_deterministic_and_fingerprint_tracks_the_vocabulary(corpus, tmp_path):
  cfg = DataConfig(source=f"text:{corpus[0]}")
  a = load_or_train_tokenizer(cfg, str(tmp_path / "a"), vocab_size=300)
  b = load_or_train_tokenizer(cfg, str(tmp_path / "b"), vocab_size=300)
  assert a.fingerprint == b.fingerprint
  c = load_or_train_tokenizer(cfg, str(tmp_path / "c"), vocab_size=290)
  assert c.fingerprint != a.fingerprint
  d = tokenizer_lib.train_bpe(iter(random_documents(60, seed=99)), 300)
  assert d.fingerprint != a.fingerprint
  with pytest.raises(ValueError, match="at least 264"):
    tokenizer_lib.train_bpe(iter(["abc"]), 100)


def test_given_hf_tokenizer_json_gets_missing_special_tokens(tmp_path):
  import tokenizers
  from tokenizers import models, pre_tokenizers
  vocab = {"<pad>": 0, "a": 1, "b": 2, "ab": 3, "<unk>": 4}
  hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
  hf.pre_tokenizer = pre_tokenizers.Whitespace()
  path = str(tmp_path / "given.json")
  hf.save(path)
  tok = Tokenizer.load(path)
  assert tok.pad_id == 0 and tok.vocab_size == 5 + 7
  assert sorted(tok.special_ids.values())[1:] == list(range(5, 12))
  assert tok.encode("ab a") == [3, 1]
  # id 0 must be the pad token: the packer pads with zeros.
  bad = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
  bad.save(str(tmp_path / "bad.json"))
  with pytest.raises(ValueError, match="id 0"):
    Tokenizer.load(str(tmp_path / "bad.json"))


def test_given_sentencepiece_model(tmp_path):
  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(random_documents(200, seed=7, max_words=30)), model_writer=model,
      vocab_size=120, model_type="bpe", pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
      user_defined_symbols=["<bos>", "<eos>"], minloglevel=2)
  path = tmp_path / "sp.model"
  path.write_bytes(model.getvalue())
  tok = Tokenizer.load(str(path))
  assert tok.pad_id == 0 and tok.bos_id == 2 and tok.eos_id == 3
  # Special tokens the model lacks are appended after its vocabulary.
  assert [tok.image_id, tok.tool_call_id, tok.tool_result_end_id] == [120, 121, 124]
  assert tok.vocab_size == 125
  text = "doc0001 abc def"
  assert tok.decode(tok.encode(text)) == text
  with_special = tok.encode("x<tool_call>y", allow_special=True)
  assert tok.tool_call_id in with_special
  assert tok.decode(with_special) == "x<tool_call>y"
  again = Tokenizer.from_json(tok.to_json())
  assert again.fingerprint == tok.fingerprint and again.encode(text) == tok.encode(text)
  cfg = DataConfig(tokenizer=str(path))
  assert load_or_train_tokenizer(cfg, None, vocab_size=128).fingerprint == tok.fingerprint
  with pytest.raises(ValueError, match="125 ids"):
    load_or_train_tokenizer(cfg, None, vocab_size=100)


def test_missing_tokenizer_file_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_or_train_tokenizer(DataConfig(tokenizer=str(tmp_path / "none.json")), None, 512)


def test_a_tokenizer_file_that_is_neither_format_is_a_named_error(tmp_path):
  """Text that is not JSON (read as a SentencePiece proto), JSON that is not a tokenizer, and
  a truncated tokenizer.json: a ValueError naming the file and the setting (they were a
  sentencepiece RuntimeError, a bare `Exception` of the tokenizers library, a message naming
  neither)."""
  for name, text, kind in (("notes.txt", "not json", "a SentencePiece .model"),
                           ("a.json", '{"a": 1}', "a tokenizer.json"),
                           ("cut.json", '{"model": {"type": "BPE", "vocab": {"a"', "a tokenizer.json")):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"tokenizer file {str(path)!r} "
                                                   f"(DataConfig.tokenizer) cannot be read as "
                                                   f"{kind} (")):
      load_or_train_tokenizer(DataConfig(tokenizer=str(path)), None, 512)


def test_long_texts_encoded_in_pieces_match_whole_text_encoding(stdlib_tokenizer):
  """Long texts are cut at safe newlines and encoded in parallel; the ids must equal those of
  encoding the whole text at once (whitespace runs, blank lines, indentation, CRLF, tabs)."""
  import tokenizers
  whole = tokenizers.Tokenizer.from_str(stdlib_tokenizer.to_json())
  whole.encode_special_tokens = True
  rng = np.random.default_rng(1)
  fragments = ["def f(x):\n", "    return x\n", "\n", "\n\n", "  \n", "\t\tpass\n", "x = 1  \n",
               "# comment <eos>\n", "class A:\r\n", "\u00e9t\u00e9 = '\u4e2d'\n", " ", "\n   \n"]
  for _ in range(3):
    text = "".join(rng.choice(fragments, 12000))
    assert len(text) > 3 * tokenizer_lib._PIECE_CHARS
    assert stdlib_tokenizer.encode(text) == whole.encode(text, add_special_tokens=False).ids


def test_cache_is_keyed_by_source_never_degenerate_and_group_readable(corpus, tmp_path,
                                                                       monkeypatch):
  """Issue 12 (newcomer): a failed run (no text: a byte-only BPE) caches nothing; a fixed data
  source then trains its own tokenizer; a cache for another source is not reused."""
  del monkeypatch
  old = os.umask(0o022)
  try:
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")  # a text file with no text
    broken = DataConfig(source=f"text:{empty}", eval_fraction=0.0)
    tok = load_or_train_tokenizer(broken, workdir, vocab_size=300)
    assert tokenizer_lib.is_degenerate(tok) and tok.vocab_size == 264
    assert os.listdir(workdir) == []  # never cached
    fixed = DataConfig(source=f"text:{corpus[0]}")
    good = load_or_train_tokenizer(fixed, workdir, vocab_size=300)
    assert good.vocab_size == 300 and not tokenizer_lib.is_degenerate(good)
    cache = os.path.join(workdir, "tokenizer.json")
    assert os.stat(cache).st_mode & 0o777 == 0o644  # readable by the group, like other outputs
    other = DataConfig(source=f"text:{corpus[0]}/d000*.txt")
    second = load_or_train_tokenizer(other, workdir, vocab_size=300)
    assert second.fingerprint != good.fingerprint  # trained on its own source, cached apart
    files = sorted(os.listdir(workdir))
    assert len(files) == 4 and files[2:] == ["tokenizer.json", "tokenizer.source.json"]
    assert files[0].startswith("tokenizer-") and files[1] == files[0][:-5] + ".source.json"
    assert load_or_train_tokenizer(fixed, workdir, 300).fingerprint == good.fingerprint
    assert load_or_train_tokenizer(other, workdir, 300).fingerprint == second.fingerprint
  finally:
    os.umask(old)
