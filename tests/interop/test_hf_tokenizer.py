"""The tokenizer a checkpoint ships (`DataConfig.tokenizer="hf:DIR"`, sparse_lm.data.tokenizer_hf):
ids equal to the libraries' own and to a plain-Python BPE, the packing pipeline, the HF import
recording it for `init_from` and `python -m sparse_lm.generate --workdir W`, and bad input.

Fixtures: tests/data/hf/tokenizer_tiktoken and tokenizer_json (make_tokenizer_fixtures.py)."""

import base64
import json
import shutil

import numpy as np
import pytest
import regex

from sparse_lm.data import DataConfig, Tokenizer, load_or_train_tokenizer, make_train_iterator
from sparse_lm.data.tokenizer_hf import KIMI_PATTERN
from sparse_lm.interop import workdir as hf_import
from tests.interop.hf_testlib import DATA, KIMI_LINEAR, KIMI_LINEAR_REF

TIKTOKEN = DATA / "tokenizer_tiktoken"
TOKJSON = DATA / "tokenizer_json"
WORDS = ["The", " quick", " brown", " fox", " model", " tokenizer", "def", " train", "(", "):",
         "\n", "    ", " loss", " =", " 100", "Kimi", " KDA", " MLA", ",", ".", " isn't", " 7",
         " zz", "Qx", "  ", "\t", " experts", " sigmoid", "!", " ids"]


def random_texts(seed, n=20):
  print("seed", seed)
  rng = np.random.default_rng(seed)
  return ["".join(rng.choice(WORDS, rng.integers(1, 40))) for _ in range(n)]


def reference_bpe(text, ranks):
  """Split by Kimi's pattern, then inside each piece merge the adjacent pair whose bytes have
  the lowest rank until none is a token (the definition of tiktoken's byte-pair encoding)."""
  ids = []
  for piece in regex.findall(KIMI_PATTERN, text, flags=regex.V1):
    parts = [bytes([b]) for b in piece.encode()]
    while len(parts) > 1:
      cands = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:]))
               if a + b in ranks]
      if not cands:
        break
      _, i = min(cands)
      parts[i:i + 2] = [parts[i] + parts[i + 1]]
    ids += [ranks[p] for p in parts]
  return ids


def library_encoding():
  """(tiktoken.Encoding, ranks, special tokens) of the fixture, built from its files here."""
  import tiktoken
  ranks = {base64.b64decode(t): int(r) for t, r in
           (line.split() for line in (TIKTOKEN / "tiktoken.model").read_text().splitlines())}
  conf = json.loads((TIKTOKEN / "tokenizer_config.json").read_text())
  special = {v["content"]: int(k) for k, v in conf["added_tokens_decoder"].items()}
  return tiktoken.Encoding(name="ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                           special_tokens=special), ranks, special


def test_tiktoken_checkpoint_tokenizer_equals_reference_bpe_and_library():
  tok = Tokenizer.load(f"hf:{TIKTOKEN}")
  lib, ranks, special = library_encoding()
  assert tok.vocab_size == 256 == len(ranks) + len(special)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (special["[BOS]"], special["[EOS]"],
                                                  special["[PAD]"]) == (217, 218, 255)
  assert tok.image_id is None and tok.tool_call_id is None  # roles the checkpoint lacks
  for text in random_texts(0):
    ids = tok.encode(text)
    assert ids == reference_bpe(text, ranks) == lib.encode(text)
    assert tok.decode(ids) == lib.decode(ids) == text
  text = "a [EOS] b<|im_end|>"
  assert not set(tok.encode(text)) & set(special.values())  # special strings stay text
  marked = tok.encode(text, allow_special=True)
  assert tok.eos_id in marked and special["<|im_end|>"] in marked
  assert tok.decode(marked) == text and tok.decode(marked, skip_special=True) == "a  b"
  again = Tokenizer.from_json(tok.to_json())  # what a checkpoint stores
  assert again.fingerprint == tok.fingerprint and again.encode(text) == tok.encode(text)
  # The fixture's ranks hold only printable ASCII, tab and newline: a byte outside them is
  # refused by name (tiktoken raised a Rust PanicException, which `except Exception` misses)
  with pytest.raises(ValueError, match=r"no token for the byte\(s\) 0xa9, 0xc3 .*159 of the "
                     r"256 single bytes are missing"):
    tok.encode("café", allow_special=True)


def test_tokenizer_json_checkpoint_tokenizer_equals_library():
  import tokenizers
  tok = Tokenizer.load(f"hf:{TOKJSON}")
  lib = tokenizers.Tokenizer.from_file(str(TOKJSON / "tokenizer.json"))
  assert tok.vocab_size == lib.get_vocab_size() == 300
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == tuple(
      lib.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
  for text in random_texts(1):
    ids = tok.encode(text)
    assert ids == lib.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == lib.decode(ids) == text
  assert Tokenizer.from_json(tok.to_json()).fingerprint == tok.fingerprint
  assert tok.fingerprint != Tokenizer.load(f"hf:{TIKTOKEN}").fingerprint


def test_pipeline_packs_documents_with_the_checkpoint_tokenizer(tmp_path):
  docs = random_texts(2, n=6)
  for i, d in enumerate(docs):
    (tmp_path / f"d{i}.txt").write_text(d)
  cfg = DataConfig(source=f"text:{tmp_path}", eval_fraction=0.0, tokenizer=f"hf:{TIKTOKEN}",
                   prefetch=0)
  tok = load_or_train_tokenizer(cfg, None, vocab_size=256)
  batch = next(make_train_iterator(cfg, tok, seq_len=64, batch_size=4))
  want = {tuple([tok.bos_id] + tok.encode(d) + [tok.eos_id])[:64] for d in docs}
  seen = 0
  for row, seg in zip(batch["tokens"], batch["segment_ids"]):
    for s in set(seg.tolist()) - {0}:
      chunk = tuple(row[seg == s].tolist())
      if chunk[0] == tok.bos_id:  # a document's first chunk
        assert chunk in want
        seen += 1
  assert seen >= 2
  with pytest.raises(ValueError, match="256 ids but the model vocab_size is 200"):
    load_or_train_tokenizer(cfg, None, vocab_size=200)
  images = DataConfig(source=cfg.source, tokenizer=cfg.tokenizer, images="digits",
                      image_ratio=0.5)
  with pytest.raises(ValueError, match="DataConfig.images='digits' needs '<image>' at id 3"):
    load_or_train_tokenizer(images, None, vocab_size=256)


def _checkpoint_with(tmp_path, tokenizer_dir):
  hf = tmp_path / "hf"
  shutil.copytree(KIMI_LINEAR, hf)
  for f in tokenizer_dir.iterdir():
    shutil.copy(f, hf / f.name)
  return hf


def test_import_records_the_tokenizer_for_generate_and_init_from(tmp_path):
  """The import keeps the checkpoint's tokenizer; `init_from=W` and the generate CLI's
  `--workdir W` loader pick it up; the engine's greedy tokens on the imported model equal
  transformers' (stored by make_kimi_linear_fixture.py) and decode as tiktoken decodes them."""
  from sparse_lm import generate
  from sparse_lm.inference import Engine, SamplingParams
  from sparse_lm.interop.hf import import_to_workdir
  w = tmp_path / "w"
  import_to_workdir(_checkpoint_with(tmp_path, TIKTOKEN), w)
  tok = Tokenizer.load(f"hf:{TIKTOKEN}")
  assert Tokenizer.load(hf_import.tokenizer_path(w)).fingerprint == tok.fingerprint
  # A stage with init_from=W (and no data.tokenizer of its own) uses it.
  data = hf_import.data_config(DataConfig(), str(w))
  assert load_or_train_tokenizer(data, None, 256).fingerprint == tok.fingerprint
  assert hf_import.data_config(DataConfig(tokenizer="x.json"), str(w)).tokenizer == "x.json"
  assert hf_import.data_config(DataConfig(), "stage_8k").tokenizer is None
  # `python -m sparse_lm.generate --workdir W` on a workdir with only the import.
  model, loaded, where = generate.load_workdir(w)
  assert loaded.fingerprint == tok.fingerprint and "HF import (kimi_linear)" in where
  ref = np.load(KIMI_LINEAR_REF)
  prompt = [int(t) for t in ref["generate_prompt"][0]]
  want = [int(t) for t in ref["generate_out"][0, len(prompt):]]
  got = Engine(model, max_length=32, max_batch=1).generate(
      [prompt], max_new_tokens=len(want), sampling=SamplingParams(temperature=0.0),
      seed=0)[0].tokens
  print("engine", list(got), "transformers", want)
  assert list(got) == want
  assert loaded.decode(got) == library_encoding()[0].decode(list(got))
  (w / "hf_import" / "tokenizer.json").unlink()  # as imported from a checkpoint without one
  with pytest.raises(FileNotFoundError, match="HF import has no tokenizer"):
    generate.load_workdir(w)


def test_bad_checkpoint_tokenizers_name_the_file_and_field(tmp_path):
  with pytest.raises(FileNotFoundError, match="is not a directory"):
    Tokenizer.load(f"hf:{tmp_path / 'none'}")
  with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tiktoken.model"):
    Tokenizer.load(f"hf:{tmp_path}")
  bad = tmp_path / "bad"
  shutil.copytree(TIKTOKEN, bad)
  conf = json.loads((bad / "tokenizer_config.json").read_text())
  (bad / "tokenizer_config.json").write_text(json.dumps({**conf, "bos_token": "<|nope|>"}))
  with pytest.raises(ValueError, match=r"tokenizer_config.json: bos_token '<\|nope\|>'"):
    Tokenizer.load(f"hf:{bad}")
  (bad / "tokenizer_config.json").write_text(json.dumps({**conf, "bos_token": None}))
  with pytest.raises(ValueError, match="no bos token"):
    Tokenizer.load(f"hf:{bad}")
  (bad / "tiktoken.model").write_text("IA== 0\nnot-base64 1\n")
  with pytest.raises(ValueError, match=r"tiktoken.model:2: expected"):
    Tokenizer.load(f"hf:{bad}")
  # A tokenizer larger than the checkpoint's vocabulary: refused before the weights are read.
  hf = tmp_path / "small_vocab"
  hf.mkdir()
  raw = json.loads((KIMI_LINEAR / "config.json").read_text())
  (hf / "config.json").write_text(json.dumps({**raw, "vocab_size": 200}))
  for f in TIKTOKEN.iterdir():
    shutil.copy(f, hf / f.name)
  with pytest.raises(ValueError, match="256 ids but config.json vocab_size is 200"):
    hf_import.checkpoint_tokenizer(hf)
  assert hf_import.checkpoint_tokenizer(KIMI_LINEAR) is None
