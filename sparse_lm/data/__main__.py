"""Inspect a data source: ``python -m sparse_lm.data [--source=stdlib] [--seq_len=256] ...``.

Prints the source summary, the tokenizer (trained and cached in ``--workdir`` if absent), the
time to the first training batch, the pipeline's throughput over a few seconds, the padding
fraction, and the start of the first row decoded.
"""

import argparse
import logging
import time

import numpy as np

from sparse_lm.data import (DataConfig, describe, load_or_train_tokenizer, make_train_iterator)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--source", default="stdlib")
  parser.add_argument("--long_documents", action="store_true")
  parser.add_argument("--packing", default="first_fit", choices=("first_fit", "best_fit"))
  parser.add_argument("--tokenizer", default=None, help="tokenizer.json or .model path")
  parser.add_argument("--workdir", default="/tmp/sparse_lm_data")
  parser.add_argument("--vocab_size", type=int, default=512)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--seconds", type=float, default=5.0, help="throughput measurement time")
  args = parser.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

  cfg = DataConfig(source=args.source, long_documents=args.long_documents,
                   packing=args.packing, tokenizer=args.tokenizer)
  start = time.perf_counter()
  print(describe(cfg), f"(listed in {time.perf_counter() - start:.1f} s)")
  start = time.perf_counter()
  tok = load_or_train_tokenizer(cfg, args.workdir, args.vocab_size)
  print(f"tokenizer: {tok} in {time.perf_counter() - start:.1f} s")
  start = time.perf_counter()
  it = make_train_iterator(cfg, tok, seq_len=args.seq_len, batch_size=args.batch_size)
  batch = next(it)
  print(f"first batch [{args.batch_size}, {args.seq_len}] after {time.perf_counter() - start:.2f} s")
  start, tokens, fill = time.perf_counter(), 0, []
  while time.perf_counter() - start < args.seconds:
    b = next(it)
    tokens += b["loss_mask"].size
    fill.append(b["loss_mask"].mean())
  elapsed = time.perf_counter() - start
  print(f"throughput: {tokens / elapsed:,.0f} tokens/s; non-padding fraction {np.mean(fill):.3f}")
  print("row 0 starts:", repr(tok.decode(batch["tokens"][0, :64])))
  it.close()


if __name__ == "__main__":
  main()
