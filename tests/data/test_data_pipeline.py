"""Packing, batching, resume, per-host sharding and the held-out batches of the Grain pipeline."""

import collections
import json

import numpy as np
import pytest

from sparse_lm.data import (DataConfig, describe, make_eval_batches, make_train_iterator,
                            open_source, state_to_json_compatible)
from data_testing import doc_marker


def _segments(batch):
  """Yields (row, start, end) of every packed segment (maximal run of one segment id > 0)."""
  for r, seg in enumerate(batch["segment_ids"]):
    bounds = np.flatnonzero(np.diff(seg)) + 1
    for start, end in zip(np.r_[0, bounds], np.r_[bounds, len(seg)]):
      if seg[start] > 0:
        yield r, int(start), int(end)


def _check_batch(batch, b, t, tok):
  assert set(batch) == {"tokens", "segment_ids", "positions", "loss_mask"}
  for k in ("tokens", "segment_ids", "positions"):
    assert batch[k].shape == (b, t) and batch[k].dtype == np.int32, k
  assert batch["loss_mask"].shape == (b, t) and batch["loss_mask"].dtype == np.float32
  seg, pos, tokens = batch["segment_ids"], batch["positions"], batch["tokens"]
  np.testing.assert_array_equal(batch["loss_mask"], (seg > 0).astype(np.float32))
  # Padding: id 0 everywhere, position 0, and only at the end of a row.
  assert np.all(tokens[seg == 0] == tok.pad_id) and np.all(pos[seg == 0] == 0)
  for row in seg:
    real = np.flatnonzero(row > 0)
    assert real.size > 0 and real[-1] == real.size - 1, "padding in the middle of a row"
    # Segment ids number the documents of a row 1, 2, 3, ... in order.
    ids = row[real]
    assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
  assert np.all(tokens[seg > 0] != tok.pad_id)
  for r, s, e in _segments(batch):
    # Positions count up by one within a segment; a segment starting at position 0 starts with
    # <bos>; <bos> appears nowhere else; <eos> only at a segment's end.
    np.testing.assert_array_equal(pos[r, s:e], np.arange(pos[r, s], pos[r, s] + e - s))
    assert (pos[r, s] == 0) == (tokens[r, s] == tok.bos_id)
    assert not np.any(tokens[r, s + 1:e] == tok.bos_id)
    assert not np.any(tokens[r, s:e - 1] == tok.eos_id)


@pytest.mark.parametrize("packing", ["first_fit", "best_fit"])
def test_packing_invariants(corpus, corpus_tokenizer, packing):
  cfg = DataConfig(source=f"text:{corpus[0]}", packing=packing, seed=7)
  it = make_train_iterator(cfg, corpus_tokenizer, seq_len=96, batch_size=4)
  fill = []
  for _ in range(25):
    batch = next(it)
    _check_batch(batch, 4, 96, corpus_tokenizer)
    fill.append(batch["loss_mask"].mean())
  it.close()
  assert np.mean(fill) > 0.8, f"packing leaves too much padding: fill {np.mean(fill):.2f}"


def test_one_epoch_reproduces_every_document_exactly(corpus, corpus_tokenizer):
  """The chunks packed in one epoch are exactly the training documents, <bos> text <eos>, cut at
  seq_len, each once: nothing lost, duplicated, truncated or merged across documents."""
  path, docs = corpus
  cfg = DataConfig(source=f"text:{path}", seed=3)
  seq_len = 64
  it = make_train_iterator(cfg, corpus_tokenizer, seq_len=seq_len, batch_size=1, num_epochs=1)
  got = collections.Counter()
  for batch in it:
    _check_batch(batch, 1, seq_len, corpus_tokenizer)
    for r, s, e in _segments(batch):
      got[(int(batch["positions"][r, s]), tuple(batch["tokens"][r, s:e].tolist()))] += 1
  tok = corpus_tokenizer
  train = open_source(cfg.source, split="train", eval_fraction=cfg.eval_fraction)
  want = collections.Counter()
  long_docs = 0
  for rel in train.doc_ids:
    text = docs[int(rel[1:5])]
    ids = [tok.bos_id] + tok.encode(text) + [tok.eos_id]
    long_docs += len(ids) > seq_len
    for s in range(0, len(ids), seq_len):
      want[(s, tuple(ids[s:s + seq_len]))] += 1
  assert long_docs > 10, "the corpus should exercise documents split across rows"
  assert got == want


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("packing,prefetch", [("first_fit", 2), ("best_fit", 0)])
def test_resume_from_state_is_exact(corpus, corpus_tokenizer, packing, prefetch):
  """Restoring get_state() into a fresh iterator continues with exactly the uninterrupted batches,
  at several cut points, across epoch boundaries, through a JSON round trip."""
  cfg = DataConfig(source=f"text:{corpus[0]}", packing=packing, prefetch=prefetch, seed=11)
  kwargs = dict(seq_len=128, batch_size=3)
  it = make_train_iterator(cfg, corpus_tokenizer, **kwargs)
  total = 70  # About three epochs of this corpus.
  reference = _take(it, total)
  it.close()
  for cut in (0, 1, 6, 23, 51):
    it = make_train_iterator(cfg, corpus_tokenizer, **kwargs)
    _assert_same(_take(it, cut), reference[:cut])
    state = json.loads(json.dumps(state_to_json_compatible(it.get_state())))
    _take(it, 3)  # Advance further: the restored iterator must not care.
    it.close()
    resumed = make_train_iterator(cfg, corpus_tokenizer, **kwargs)
    resumed.set_state(state)
    _assert_same(_take(resumed, total - cut), reference[cut:])
    resumed.close()


def test_deterministic_and_seed_dependent(corpus, corpus_tokenizer):
  kwargs = dict(seq_len=64, batch_size=2)
  cfg = DataConfig(source=f"text:{corpus[0]}", seed=5)
  a = _take(make_train_iterator(cfg, corpus_tokenizer, **kwargs), 5)
  b = _take(make_train_iterator(cfg, corpus_tokenizer, **kwargs), 5)
  _assert_same(a, b)
  other = DataConfig(source=f"text:{corpus[0]}", seed=6)
  c = _take(make_train_iterator(other, corpus_tokenizer, **kwargs), 5)
  assert not all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))


def _documents_seen(batches, tok):
  seen = []
  for batch in batches:
    for r, s, e in _segments(batch):
      if batch["positions"][r, s] == 0:
        seen.append(doc_marker(tok.decode(batch["tokens"][r, s + 1:e])))
  assert None not in seen
  return seen


def test_hosts_read_disjoint_documents(corpus, corpus_tokenizer):
  cfg = DataConfig(source=f"text:{corpus[0]}", seed=2)
  per_host = []
  for host in range(2):
    it = make_train_iterator(cfg, corpus_tokenizer, seq_len=256, batch_size=1, process_index=host,
                             process_count=2, num_epochs=1)
    per_host.append(_documents_seen(list(it), corpus_tokenizer))
  a, b = per_host
  assert len(a) == len(set(a)) and len(b) == len(set(b))
  assert not set(a) & set(b)
  train = open_source(cfg.source, split="train", eval_fraction=cfg.eval_fraction)
  assert set(a) | set(b) == {int(rel[1:5]) for rel in train.doc_ids}
  assert abs(len(a) - len(b)) <= 1
  with pytest.raises(ValueError, match="process_index"):
    make_train_iterator(cfg, corpus_tokenizer, seq_len=64, batch_size=1, process_index=2,
                        process_count=2)


def test_eval_batches_come_from_the_held_out_split_only(corpus, corpus_tokenizer):
  cfg = DataConfig(source=f"text:{corpus[0]}", eval_fraction=0.2)
  kwargs = dict(seq_len=64, batch_size=2, num_batches=6)
  batches = make_eval_batches(cfg, corpus_tokenizer, **kwargs)
  assert len(batches) == 6
  for batch in batches:
    _check_batch(batch, 2, 64, corpus_tokenizer)
  # Deterministic, and independent of the training seed.
  _assert_same(batches, make_eval_batches(DataConfig(source=cfg.source, eval_fraction=0.2,
                                                     seed=99), corpus_tokenizer, **kwargs))
  held_out = open_source(cfg.source, split="eval", eval_fraction=0.2)
  eval_docs = {int(rel[1:5]) for rel in held_out.doc_ids}
  assert set(_documents_seen(batches, corpus_tokenizer)) <= eval_docs
  train = make_train_iterator(cfg, corpus_tokenizer, seq_len=256, batch_size=1, num_epochs=1)
  assert not set(_documents_seen(list(train), corpus_tokenizer)) & eval_docs
  # More batches than the split holds: fewer come back, the last padded with empty rows.
  everything = make_eval_batches(cfg, corpus_tokenizer, seq_len=64, batch_size=2,
                                 num_batches=10_000)
  assert 6 < len(everything) < 10_000
  assert everything[-1]["tokens"].shape == (2, 64)


def test_config_validation_names_the_field():
  for kwargs, field in [(dict(packing="greedy"), "packing"), (dict(eval_fraction=1.5),
                        "eval_fraction"), (dict(prefetch=-1), "prefetch"), (dict(seed=-3), "seed")]:
    with pytest.raises(ValueError, match=field):
      DataConfig(**kwargs)


@pytest.mark.parametrize("texts", [[""], ["\n\n   \n\n"], ["", " \t\n"]])
def test_a_source_without_text_is_refused_before_training(tmp_path, corpus_tokenizer, texts):
  """A newcomer's empty `text:` file used to hang the run: one document, no token, and the
  packer waited for a first token forever. Now the train iterator refuses it by name."""
  for i, text in enumerate(texts):
    (tmp_path / f"doc{i}.txt").write_text(text)
  source = f"text:{tmp_path}" if len(texts) > 1 else f"text:{tmp_path / 'doc0.txt'}"
  cfg = DataConfig(source=source, eval_fraction=0.0, prefetch=0)
  with pytest.raises(ValueError, match=r"training document\(s\) hold no text"):
    make_train_iterator(cfg, corpus_tokenizer, seq_len=32, batch_size=2)
  (tmp_path / "doc0.txt").write_text("def f():\n  return 1\n")  # one line of text: trains
  batch = next(iter(make_train_iterator(cfg, corpus_tokenizer, seq_len=32, batch_size=2)))
  assert batch["tokens"].shape == (2, 32) and batch["loss_mask"].sum() > 0


def test_unknown_source_scheme_lists_valid_schemes():
  with pytest.raises(ValueError) as e:
    DataConfig(source="hdfs:/data/x")
  for scheme in ("stdlib", "text:", "jsonl:", "parquet:", "arrayrecord:"):
    assert scheme in str(e.value)


def test_stdlib_default_source_first_batch_and_long_view(stdlib_tokenizer):
  """The default source: train/eval documents of the standard library, a quick first batch, and
  the long-document view that never mixes held-out files into training documents."""
  cfg = DataConfig()
  line = describe(cfg)
  assert "stdlib" in line and "train" in line and "eval" in line
  it = make_train_iterator(cfg, stdlib_tokenizer, seq_len=256, batch_size=4)
  _check_batch(next(it), 4, 256, stdlib_tokenizer)
  it.close()
  short_eval = set(open_source("stdlib", split="eval", eval_fraction=0.02).doc_ids)
  long_train = open_source("stdlib", split="train", eval_fraction=0.02, long_documents=True)
  long_eval = open_source("stdlib", split="eval", eval_fraction=0.02, long_documents=True)
  assert len(long_train) < 100 < len(open_source("stdlib", split="train", eval_fraction=0.02))
  train_files = {f for i in range(len(long_train)) for f in long_train.member_files(i)}
  eval_files = {f for i in range(len(long_eval)) for f in long_eval.member_files(i)}
  assert eval_files == short_eval and not train_files & eval_files
  asyncio = [i for i, d in enumerate(long_train.doc_ids) if d.startswith("asyncio")]
  assert asyncio and len(long_train.member_files(asyncio[0])) > 10


def test_state_from_another_pipeline_is_refused(corpus, corpus_tokenizer):
  cfg = DataConfig(source=f"text:{corpus[0]}", prefetch=0)
  it = make_train_iterator(cfg, corpus_tokenizer, seq_len=64, batch_size=2)
  next(it)
  state = it.get_state()
  other = make_train_iterator(cfg, corpus_tokenizer, seq_len=64, batch_size=4)
  with pytest.raises(ValueError, match="batch_size: 2 vs 4"):
    other.set_state(state)
  reseeded = make_train_iterator(DataConfig(source=cfg.source, seed=1), corpus_tokenizer,
                                 seq_len=64, batch_size=2)
  with pytest.raises(ValueError, match="seed: 0 vs 1"):
    reseeded.set_state(state)
  with pytest.raises(ValueError, match="not a data-iterator state"):
    other.set_state({"next_index": 3})


def test_one_file_corpus_is_split_by_its_tail_or_not_at_all(corpus, corpus_tokenizer, tmp_path):
  """Issue 12 (newcomer): `text:input.txt` trains; the held-out split is the file's last
  eval_fraction (cut at a line break), or there is none with eval_fraction=0."""
  from sparse_lm.data import splits
  book = tmp_path / "input.txt"
  text = "".join(f"line {i}: " + "word " * (i % 7) + "\n" for i in range(2000))
  book.write_text(text)
  cfg = DataConfig(source=f"text:{book}", eval_fraction=0.1, prefetch=0)
  train = splits.open_split(cfg.source, split="train", eval_fraction=0.1)
  held = splits.open_split(cfg.source, split="eval", eval_fraction=0.1)
  assert (train.split_by, held.split_by, len(train), len(held)) == ("tail", "tail", 1, 1)
  head, tail = train.load(0), held.load(0)
  assert head + tail == text and head.endswith("\n")  # disjoint, complete, at a line break
  assert len(tail) == pytest.approx(0.1 * len(text), abs=40)
  assert "by tail" in describe(cfg)
  batch = next(make_train_iterator(cfg, corpus_tokenizer, seq_len=64, batch_size=2))
  assert batch["tokens"].shape == (2, 64)
  evals = make_eval_batches(cfg, corpus_tokenizer, seq_len=64, batch_size=2, num_batches=2)
  assert len(evals) == 2
  want = corpus_tokenizer.encode(tail)
  got = evals[0]["tokens"][0][evals[0]["segment_ids"][0] == 1][1:]  # after <bos>
  assert list(got[:20]) == want[:20]  # the held-out rows start with the file's tail
  # Documents mode on one file: one clear way out, no back and forth.
  by_docs = DataConfig(source=cfg.source, eval_fraction=0.1, eval_split="documents")
  errors = []
  for make in (lambda: make_train_iterator(by_docs, corpus_tokenizer, seq_len=64, batch_size=2),
               lambda: make_eval_batches(by_docs, corpus_tokenizer, seq_len=64, batch_size=2,
                                         num_batches=1)):
    try:
      make()
    except ValueError as e:
      errors.append(str(e))
  assert len(errors) == 1 and "data.eval_split=tail" in errors[0]
  assert "data.eval_fraction=0" in errors[0]
  none = DataConfig(source=cfg.source, eval_fraction=0.0, prefetch=0)
  assert make_eval_batches(none, corpus_tokenizer, seq_len=64, batch_size=2, num_batches=1) == []
  assert "no held-out split" in describe(none)
  assert next(make_train_iterator(none, corpus_tokenizer, seq_len=64, batch_size=2))[
      "tokens"].shape == (2, 64)
  # A corpus of many documents keeps the document split under "auto".
  many = splits.open_split(f"text:{corpus[0]}", split="eval", eval_fraction=0.2)
  assert many.split_by == "documents" and len(many) > 0
