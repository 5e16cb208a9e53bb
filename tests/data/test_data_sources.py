"""Document sources: the file formats, the held-out split, and bad input."""

import json
import logging
import os

import numpy as np
import pytest

from data_testing import random_documents, write_text_corpus
from sparse_lm.data import (DataConfig, describe, is_eval_document, load_or_train_tokenizer,
                            make_train_iterator, open_source)


def _all_texts(spec, eval_fraction=0.25):
  """{doc_id: text} over both splits, checking that the splits are disjoint."""
  train = open_source(spec, split="train", eval_fraction=eval_fraction)
  held_out = open_source(spec, split="eval", eval_fraction=eval_fraction)
  assert not set(train.doc_ids) & set(held_out.doc_ids)
  assert len(held_out) > 0 and len(train) > len(held_out)
  texts = {}
  for source in (train, held_out):
    for i, doc_id in enumerate(source.doc_ids):
      texts[doc_id] = source.load(i)
  return texts


def test_text_source_file_directory_and_glob(tmp_path):
  docs = random_documents(40, seed=1)
  root = write_text_corpus(tmp_path / "c", docs)
  os.makedirs(tmp_path / "c" / "sub")
  (tmp_path / "c" / "sub" / "extra.md").write_text("doc9999 nested file\n")
  by_dir = _all_texts(f"text:{root}")
  assert len(by_dir) == 41 and by_dir[os.path.join("sub", "extra.md")] == "doc9999 nested file\n"
  assert [by_dir[f"d{i:04d}.txt"] for i in range(40)] == docs
  by_glob = _all_texts(f"text:{root}/*.txt")
  assert sorted(by_glob) == [f"d{i:04d}.txt" for i in range(40)]
  one = open_source(f"text:{root}/d0003.txt", split="train", eval_fraction=0.0)
  assert one.doc_ids == ["d0003.txt"] and one.load(0) == docs[3]


def test_jsonl_source(tmp_path):
  docs = random_documents(50, seed=2)
  path = tmp_path / "corpus.jsonl"
  with open(path, "w", encoding="utf-8") as f:
    for i, text in enumerate(docs):
      f.write(json.dumps({"text": text, "id": i}) + "\n")
      if i == 10:
        f.write("\n")  # A blank line is not a document.
  texts = _all_texts(f"jsonl:{path}")
  assert sorted(texts.values()) == sorted(docs)
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"content": "x"}) + "\n")
  with pytest.raises(ValueError, match="'text'"):
    open_source(f"jsonl:{bad}", split="train", eval_fraction=0.0).load(0)
  # a text that is not a string is named (it was dropped silently; with every record so, the
  # error said the documents were empty); null is an empty document
  odd = bad  # rewritten: the cached listing is not reused for a changed file
  odd.write_text(json.dumps({"text": 123}) + "\n" + json.dumps({"text": None}) + "\n")
  src = open_source(f"jsonl:{odd}", split="train", eval_fraction=0.0)
  with pytest.raises(ValueError, match=r"bad.jsonl:0: JSON field 'text' is a int \('123'\), "
                     "not a string"):
    src.load(0)
  assert src.load(1) is None


def test_parquet_source(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  docs = random_documents(60, seed=3)
  path = tmp_path / "corpus.parquet"
  pq.write_table(pa.table({"text": docs, "n": np.arange(60)}), path, row_group_size=16)
  texts = _all_texts(f"parquet:{path}")
  assert texts == {f"corpus.parquet:{i}": d for i, d in enumerate(docs)}
  pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
  with pytest.raises(ValueError, match="no column 'text'"):
    open_source(f"parquet:{tmp_path / 'bad.parquet'}", split="train", eval_fraction=0.0)


def test_arrayrecord_source_text_and_json_records(tmp_path):
  from array_record.python import array_record_module
  docs = random_documents(30, seed=4)
  path = str(tmp_path / "corpus.array_record")
  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  for i, text in enumerate(docs):
    record = json.dumps({"text": text}) if i % 2 else text
    writer.write(record.encode("utf-8"))
  writer.close()
  texts = _all_texts(f"arrayrecord:{path}")
  assert texts == {f"corpus.array_record:{i}": d for i, d in enumerate(docs)}


def test_held_out_split_is_a_stable_function_of_the_document_id():
  ids = [f"pkg/module_{i}.py" for i in range(20_000)]
  chosen = [d for d in ids if is_eval_document(d, 0.05)]
  assert 0.04 < len(chosen) / len(ids) < 0.06
  assert chosen == [d for d in ids if is_eval_document(d, 0.05)]
  # Nested: raising the fraction only adds documents to the held-out split.
  assert set(chosen) <= {d for d in ids if is_eval_document(d, 0.2)}
  assert not any(is_eval_document(d, 0.0) for d in ids)
  # Pinned: the split must not change between runs, hosts or library versions (blake2b of the
  # id, not Python's salted hash()).
  assert "".join("1" if is_eval_document(f"doc/{i}", 0.1) else "0" for i in range(100)) == (
      "0000000000010000010001000000100000000001000000000000001000100000000010010010010010011000"
      "000000000000")


def test_held_out_split_pinned_across_processes():
  import subprocess
  import sys
  code = ("from sparse_lm.data import is_eval_document as e;"
          "print(''.join('1' if e(f'doc/{i}', 0.1) else '0' for i in range(200)))")
  outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
          for seed in (1, 2)}
  here = "".join("1" if is_eval_document(f"doc/{i}", 0.1) else "0" for i in range(200))
  assert outs == {here + "\n"}


@pytest.mark.parametrize("scheme", ["text", "jsonl", "parquet", "arrayrecord"])
def test_missing_path_error_lists_what_was_searched(tmp_path, scheme):
  missing = tmp_path / "nope" / "*.dat"
  with pytest.raises(FileNotFoundError) as e:
    open_source(f"{scheme}:{missing}", split="train", eval_fraction=0.02)
  msg = str(e.value)
  assert str(missing) in msg and str(tmp_path / "nope") in msg
  assert "does not exist" in msg and "0 files matched" in msg and "stdlib" in msg


def test_empty_directory_error_lists_what_was_searched(tmp_path):
  empty = tmp_path / "empty"
  os.makedirs(empty / "subdir")
  (tmp_path / "other.txt").write_text("not in the searched directory")
  with pytest.raises(FileNotFoundError) as e:
    make_train_iterator(DataConfig(source=f"text:{empty}"), None, seq_len=8, batch_size=1)
  msg = str(e.value)
  assert str(empty) in msg and "1 entries" in msg and "subdir" in msg and "0 files matched" in msg


def test_binary_and_non_utf8_files_are_skipped_or_repaired_and_counted(tmp_path, caplog):
  docs = random_documents(30, seed=5)
  root = write_text_corpus(tmp_path / "c", docs)
  (tmp_path / "c" / "blob.bin").write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 5000,
                                                                                     np.uint8))
                                            + b"\x00\x00")
  (tmp_path / "c" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
  latin1 = "doc0777 caf\u00e9 na\u00efve r\u00e9sum\u00e9 " * 20
  (tmp_path / "c" / "latin1.txt").write_bytes(latin1.encode("latin-1"))
  spec = f"text:{root}"
  with caplog.at_level(logging.WARNING):
    train = open_source(spec, split="train", eval_fraction=0.0)
  assert train.stats.skipped_binary == 2 and train.stats.files == 33
  assert "skipped 2 binary file(s)" in caplog.text
  assert "blob.bin" not in train.doc_ids and "latin1.txt" in train.doc_ids
  text = train.load(train.doc_ids.index("latin1.txt"))
  assert text.count("\ufffd") == 80 and "doc0777 caf\ufffd" in text
  assert train.stats.repaired_files == 1 and train.stats.replaced_chars == 80
  assert "undecodable bytes" in caplog.text
  # The run continues: a tokenizer trains and batches flow.
  cfg = DataConfig(source=spec, eval_fraction=0.0)
  tok = load_or_train_tokenizer(cfg, str(tmp_path / "run"), vocab_size=300)
  it = make_train_iterator(cfg, tok, seq_len=64, batch_size=2, num_epochs=1)
  assert sum(b["loss_mask"].sum() for b in it) > 1000
  assert "skipped 2 binary" in describe(cfg)


def test_a_corpus_of_only_binary_files_is_an_error(tmp_path):
  os.makedirs(tmp_path / "bin")
  (tmp_path / "bin" / "a.bin").write_bytes(b"\x00\x01\x02")
  with pytest.raises(ValueError, match="1 skipped as binary"):
    make_train_iterator(DataConfig(source=f"text:{tmp_path / 'bin'}"), None, seq_len=8,
                        batch_size=1)
