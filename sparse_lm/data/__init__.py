"""Pretraining data: sources, tokenizer and the Grain packing pipeline.

  from sparse_lm.data import DataConfig, load_or_train_tokenizer, make_train_iterator
  tok = load_or_train_tokenizer(DataConfig(), workdir, vocab_size=512)
  it = make_train_iterator(DataConfig(), tok, seq_len=256, batch_size=8)
  batch = next(it)  # tokens / segment_ids / positions int32 [8, 256], loss_mask float32
  state = it.get_state()  # save with the checkpoint; it.set_state(state) to resume
"""

from sparse_lm.data.pipeline import (
    DataConfig,
    PipelineChangedError,
    describe,
    make_eval_batches,
    make_train_iterator,
    state_to_json_compatible,
)
from sparse_lm.data.sources import SCHEMES, is_eval_document, open_source
from sparse_lm.data.tokenizer import SPECIAL_TOKENS, Tokenizer, load_or_train_tokenizer
from sparse_lm.data.tokenizer_hf import HFCheckpointTokenizer  # registers hf:DIR

__all__ = [
    "DataConfig", "PipelineChangedError", "describe", "load_or_train_tokenizer", "make_eval_batches",
    "make_train_iterator", "state_to_json_compatible", "SCHEMES", "SPECIAL_TOKENS", "Tokenizer",
    "HFCheckpointTokenizer",
    "is_eval_document", "open_source",
]
