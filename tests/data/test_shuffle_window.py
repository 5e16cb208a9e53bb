"""DataConfig.shuffle_window: packed rows shuffled within consecutive windows before batching,
resumable exactly, and refused by a pipeline without it."""

import dataclasses
import json

import pytest

from sparse_lm.data import DataConfig, make_train_iterator, state_to_json_compatible


def _rows(batches):
  """Each row as bytes of its tokens, segment ids and positions (in stream order)."""
  return [b"".join(batch[k][r].tobytes() for k in ("tokens", "segment_ids", "positions"))
          for batch in batches for r in range(batch["tokens"].shape[0])]


def _take(cfg, tok, n, state=None):
  it = make_train_iterator(cfg, tok, seq_len=64, batch_size=3)
  if state is not None:
    it.set_state(state)
  out = [next(it) for _ in range(n)]
  return out, it


def test_shuffle_window_permutes_rows_within_windows_and_resumes_exactly(corpus,
                                                                          corpus_tokenizer):
  plain = DataConfig(source=f"text:{corpus[0]}", seed=3, prefetch=0)
  shuffled = dataclasses.replace(plain, shuffle_window=12)
  a, it = _take(plain, corpus_tokenizer, 8)  # 24 rows = two windows of 12
  it.close()
  b, it = _take(shuffled, corpus_tokenizer, 10)
  it.close()
  ra, rb = _rows(a), _rows(b)[:24]
  for w in (0, 12):  # the same rows as the unshuffled stream's window, in another order
    assert sorted(rb[w:w + 12]) == sorted(ra[w:w + 12])
    assert rb[w:w + 12] != ra[w:w + 12]
  for cut in (2, 5):  # 6 and 15 rows: inside the first and the second window
    head, it = _take(shuffled, corpus_tokenizer, cut)
    assert _rows(head) == _rows(b[:cut])
    state = json.loads(json.dumps(state_to_json_compatible(it.get_state())))
    it.close()
    rest, it = _take(shuffled, corpus_tokenizer, 10 - cut, state)
    it.close()
    assert _rows(rest) == _rows(b[cut:]), f"resume at batch {cut} differs"
  other = make_train_iterator(plain, corpus_tokenizer, seq_len=64, batch_size=3)
  with pytest.raises(ValueError, match="shuffle_window: 12 vs 0"):
    other.set_state(state)
  other.close()
  with pytest.raises(ValueError, match="shuffle_window"):
    DataConfig(shuffle_window=-1)
