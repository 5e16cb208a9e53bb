"""Audit (hand mutation testing of sparse_lm/data/pipeline.py's packing: `_Chunk`,
`_packed_rows`, `_finalize`, the train/eval batching): exact checks on synthetic documents
whose every token names its document and in-document position, so each packed segment can be
traced back to the one chunk it must be.

- Every packed row, both packings: tokens / segment ids / positions int32, loss_mask float32
  equal to (segment id > 0); padding only at the end of a row (token 0, position 0, segment 0);
  segment ids 1, 2, ... in order, a new id at every document boundary; each segment is exactly
  one chunk doc[p0 : p0 + n] with p0 a multiple of seq_len, n = min(seq_len, len - p0), and its
  positions are p0, p0 + 1, ...; the chunks of one pass are exactly every chunk of every
  document, each once. Lengths include seq_len - 1, seq_len, seq_len + 1 (a 1-token last chunk),
  2 seq_len + 1 and 1 (the tests on real text never hit a length of k seq_len + 1 for sure).
- best_fit differs from first_fit where it must: chunks of 5, 6, 4 tokens into rows of 10 with
  two bins put the 4 beside the 6 (the tighter bin), not beside the 5.
- the number of packing bins: more bins pack tighter, bounded to ~8M tokens (2**23) of
  buffer per feature and at most 16, never fewer than the batch (pipeline.py `_num_bins`):
  one bin (greedy next-fit) would leave much padding and no test of fill would notice at
  every seq_len.
- make_train_iterator with finite epochs drops the last partial batch (every batch has
  batch_size rows); make_eval_batches pads its last batch to batch_size rows with empty rows.
"""

import collections

import grain
import numpy as np
import pytest

from sparse_lm.data import DataConfig, make_eval_batches, make_train_iterator
from sparse_lm.data.pipeline import _finalize, _num_bins, _packed_rows

SEQ = 16
LENGTHS = [1, 15, 16, 17, 33, 5, 48, 2, 31, 49, 7, 3, 16, 65, 9, 12, 4, 30]
SCALE = 1000  # token = SCALE * (doc + 1) + in-document position: never 0 (padding)


def _docs(lengths):
  return [(SCALE * (d + 1) + np.arange(n)).astype(np.int32) for d, n in enumerate(lengths)]


def _pack(docs, packing, *, seq_len=SEQ, num_bins=4, batch=3):
  ds = grain.MapDataset.source(docs).to_iter_dataset()
  rows = _packed_rows(ds, DataConfig(packing=packing, seed=1), seq_len, num_bins,
                      shuffle_bins=False)
  return [_finalize(r, batch) for r in rows.batch(batch)]


def _runs(seg_row):
  """(start, end) of every maximal run of one segment id > 0."""
  bounds = np.flatnonzero(np.diff(seg_row)) + 1
  return [(int(s), int(e)) for s, e in zip(np.r_[0, bounds], np.r_[bounds, len(seg_row)])
          if seg_row[s] > 0]


@pytest.mark.parametrize("packing", ["first_fit", "best_fit"])
def test_every_row_is_whole_chunks_with_exact_ids_positions_and_mask(packing):
  docs = _docs(LENGTHS)
  batches = _pack(docs, packing)
  got = collections.Counter()
  for b in batches:
    for k in ("tokens", "segment_ids", "positions"):
      assert b[k].dtype == np.int32 and b[k].shape == (3, SEQ), k
    assert b["loss_mask"].dtype == np.float32 and b["loss_mask"].shape == (3, SEQ)
    np.testing.assert_array_equal(b["loss_mask"], (b["segment_ids"] > 0).astype(np.float32))
    for tok, seg, pos in zip(b["tokens"], b["segment_ids"], b["positions"]):
      real = np.flatnonzero(seg > 0)
      if real.size == 0:  # an empty row (the eval-style padding of the last batch)
        assert not tok.any() and not pos.any()
        continue
      n_real = real[-1] + 1
      assert real.size == n_real, f"padding inside a row: {seg}"
      assert not tok[n_real:].any() and not pos[n_real:].any()
      runs = _runs(seg)
      assert [seg[s] for s, _ in runs] == list(range(1, len(runs) + 1)), seg
      for s, e in runs:
        d, p0 = divmod(int(tok[s]), SCALE)
        d -= 1
        n = min(SEQ, LENGTHS[d] - p0)
        # one whole chunk: its start on the seq_len grid, its full length, nothing after it
        assert p0 % SEQ == 0 and e - s == n, (d, p0, s, e, tok)
        np.testing.assert_array_equal(tok[s:e], docs[d][p0:p0 + n])
        np.testing.assert_array_equal(pos[s:e], np.arange(p0, p0 + n))
        got[(d, p0)] += 1
  want = collections.Counter((d, p0) for d, n in enumerate(LENGTHS) for p0 in range(0, n, SEQ))
  assert got == want


def test_best_fit_uses_the_tightest_bin_and_first_fit_the_first():
  docs = _docs([5, 6, 4])
  together = {}
  for packing in ("first_fit", "best_fit"):
    rows = [r for b in _pack(docs, packing, seq_len=10, num_bins=2, batch=1)
            for r in b["tokens"]]
    (row,) = [r for r in rows if (r // SCALE == 3).any()]  # the row holding doc 2
    together[packing] = sorted({int(t) // SCALE - 1 for t in row if t})
  assert together == {"first_fit": [0, 2], "best_fit": [1, 2]}


def test_finite_epoch_batches_are_full_and_eval_pads_the_last(corpus, corpus_tokenizer):
  cfg = DataConfig(source=f"text:{corpus[0]}", seed=4, prefetch=0, eval_fraction=0.2)
  rows = 0
  for b in make_train_iterator(cfg, corpus_tokenizer, seq_len=64, batch_size=7, num_epochs=1):
    assert all(v.shape[0] == 7 for v in b.values()), {k: v.shape for k, v in b.items()}
    rows += 7
  assert rows > 7
  everything = make_eval_batches(cfg, corpus_tokenizer, seq_len=64, batch_size=7,
                                 num_batches=10_000)
  last = everything[-1]
  assert all(v.shape == (7, 64) for k, v in last.items()), {k: v.shape for k, v in last.items()}
  # How many rows the split packs into (an exact count, from the unpadded rows): the last
  # batch must be partial here for the padding to be exercised.
  n_rows = sum(int((b["segment_ids"].max(axis=1) > 0).sum()) for b in everything)
  assert n_rows % 7, "pick a batch size that leaves the eval split's last batch partial"
  assert not last["segment_ids"][n_rows % 7:].any() and not last["loss_mask"][n_rows % 7:].any()


def test_packing_bins_follow_the_buffer_bound():
  assert _num_bins(96, 4) == 16  # short rows: the 16-bin cap
  assert _num_bins(1 << 20, 4) == 8  # 1M-token rows: 8M tokens of buffer
  assert _num_bins(1 << 23, 2) == 2 and _num_bins(1 << 22, 1) == 2
  assert _num_bins(1 << 20, 32) == 32  # never fewer bins than rows per batch
  # more bins, tighter rows: chunks 10, 10, 5, 5 into rows of 15 make 2 full rows
  rows = [r for b in _pack(_docs([10, 10, 5, 5]), "first_fit", seq_len=15,
                           num_bins=_num_bins(15, 1), batch=1) for r in b["segment_ids"]]
  assert len(rows) == 2 and all(r.all() for r in rows)
