"""Tokenizer: byte-level BPE trained on the training split at first use, or a given model.

The special tokens are reserved from the start, in this order, so a tokenizer trained here has
fixed ids for them (``<pad>`` = 0 always):

  0 <pad>  1 <bos>  2 <eos>  3 <image>  4 <tool_call>  5 </tool_call>  6 <tool_result>
  7 </tool_result>

``<image>`` and the tool-call tokens are unused in pretraining; they exist so that the
vision and agentic-RL stages need no vocabulary change. Plain text never produces them:
``encode`` tokenizes a literal ``"<eos>"`` in the text as ordinary characters unless
``allow_special=True``.

A ``Tokenizer`` wraps either an HF ``tokenizers.Tokenizer`` (a trained byte-level BPE, or a given
``tokenizer.json``) or a SentencePiece model (a given ``.model`` file). ``fingerprint`` is a hash
of the vocabulary and merges; a checkpoint records it, and resuming with another tokenizer is an
error (checked by the training loop).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from sparse_lm.data import splits

_log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<image>", "<tool_call>", "</tool_call>",
                  "<tool_result>", "</tool_result>")
_BYTE_ALPHABET = 256
# Bytes of training text sampled to train the BPE: a few seconds on 2 cores for a 32K vocab.
TOKENIZER_SAMPLE_BYTES = 8 << 20
TOKENIZER_FILENAME = "tokenizer.json"
# Long texts are encoded in pieces of about this many characters with ``encode_batch``, which
# runs in parallel and releases the GIL (``encode`` holds it for the whole text).
_PIECE_CHARS = 16384
# Safe cut points for the GPT-2 byte-level pre-tokenizer: after a newline that follows a
# non-space and precedes a non-space, the pre-tokenizer always ends a pre-token, so the pieces'
# ids concatenate to exactly the ids of the whole text.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


# Tokenizers of other formats register here (tokenizer_hf.py, imported by the package): the
# key of their `to_json` object -> constructor from its value; a `load` path prefix ("hf:")
# -> constructor from the rest of the path.
JSON_FORMATS: dict[str, Callable[[dict], Tokenizer]] = {}
PATH_PREFIXES: dict[str, Callable[[str], Tokenizer]] = {}


def _pieces(text: str) -> list[str]:
  if len(text) <= _PIECE_CHARS:
    return [text]
  out, current, size = [], [], 0
  for part in _SAFE_CUT.split(text):
    current.append(part)
    size += len(part)
    if size >= _PIECE_CHARS:
      out.append("".join(current))
      current, size = [], 0
  if current:
    out.append("".join(current))
  return out


class Tokenizer:
  """Text <-> token ids, with the reserved special tokens. Thread-safe for encode/decode."""

  def __init__(self, *, hf=None, sp_model_proto: bytes | None = None):
    if (hf is None) == (sp_model_proto is None):
      raise ValueError("give exactly one of an HF tokenizer or a SentencePiece model proto")
    self._hf = self._hf_raw = self._sp = None
    self._sp_proto = sp_model_proto
    self._extra: dict[str, int] = {}  # Special tokens appended after a SentencePiece vocab.
    if hf is not None:
      self._init_hf(hf)
    else:
      self._init_sp(sp_model_proto)
    for name in SPECIAL_TOKENS:
      if self.token_to_id(name) is None:
        raise ValueError(f"tokenizer lacks the special token {name!r}")  # Not reachable.
    if self.pad_id != 0:
      raise ValueError(
          f"tokenizer has '<pad>' at id {self.pad_id}, but the pipeline pads with id 0 (the "
          "padding rows of a packed batch are zeros). Use a tokenizer whose id 0 is '<pad>' "
          "(the BPE trained here does this), or leave DataConfig.tokenizer=None.")

  # -- construction ---------------------------------------------------------------------------

  def _init_hf(self, hf) -> None:
    import tokenizers  # pylint: disable=g-import-not-at-top
    missing = [t for t in SPECIAL_TOKENS if hf.token_to_id(t) is None]
    if missing:
      hf.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in missing])
    self._hf = hf
    pre = hf.pre_tokenizer
    self._cuttable = (hf.normalizer is None and isinstance(pre, tokenizers.pre_tokenizers.ByteLevel)
                      and getattr(pre, "use_regex", False))
    # A second instance that treats special-token strings in the input as plain text.
    self._hf_raw = tokenizers.Tokenizer.from_str(hf.to_str())
    self._hf_raw.encode_special_tokens = True

  def _init_sp(self, proto: bytes) -> None:
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
    base = self._sp.get_piece_size()
    for name in SPECIAL_TOKENS:
      if self._sp_piece_id(name) is None:
        self._extra[name] = base + len(self._extra)
    if self._sp_piece_id("<pad>") is None and self._sp.pad_id() == 0:
      self._extra.pop("<pad>", None)  # Model's own pad piece (e.g. "<pad>" spelled otherwise).

  def _sp_piece_id(self, piece: str) -> int | None:
    i = self._sp.piece_to_id(piece)
    return i if i != self._sp.unk_id() or piece == self._sp.id_to_piece(i) else None

  # -- vocabulary ------------------------------------------------------------------------------

  def token_to_id(self, token: str) -> int | None:
    if self._hf is not None:
      return self._hf.token_to_id(token)
    if token in self._extra:
      return self._extra[token]
    if token == "<pad>" and self._sp.pad_id() == 0:
      return 0
    return self._sp_piece_id(token)

  @property
  def vocab_size(self) -> int:
    """Number of ids (the model's embedding table must have at least this many rows)."""
    if self._hf is not None:
      return self._hf.get_vocab_size(with_added_tokens=True)
    return self._sp.get_piece_size() + len(self._extra)

  pad_id = property(lambda self: self.token_to_id("<pad>"))
  bos_id = property(lambda self: self.token_to_id("<bos>"))
  eos_id = property(lambda self: self.token_to_id("<eos>"))
  image_id = property(lambda self: self.token_to_id("<image>"))
  tool_call_id = property(lambda self: self.token_to_id("<tool_call>"))
  tool_call_end_id = property(lambda self: self.token_to_id("</tool_call>"))
  tool_result_id = property(lambda self: self.token_to_id("<tool_result>"))
  tool_result_end_id = property(lambda self: self.token_to_id("</tool_result>"))

  @property
  def special_ids(self) -> dict[str, int]:
    return {t: self.token_to_id(t) for t in SPECIAL_TOKENS}

  @functools.cached_property
  def fingerprint(self) -> str:
    """A 16-hex-digit hash of the vocabulary, merges and special tokens (stable across saves)."""
    if self._hf is not None:
      spec = json.loads(self._hf.to_str())
      canonical = {"model": spec.get("model"),
                   "added": sorted((t["id"], t["content"]) for t in spec.get("added_tokens", []))}
      payload = json.dumps(canonical, sort_keys=True, ensure_ascii=False).encode("utf-8")
    else:
      payload = self._sp_proto + json.dumps(sorted(self._extra.items())).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]

  # -- encode / decode ------------------------------------------------------------------------

  def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
    """Token ids of ``text`` (no <bos>/<eos> added). Special-token strings in ``text`` are
    plain characters unless ``allow_special``."""
    if self._hf is not None:
      hf = self._hf if allow_special else self._hf_raw
      pieces = _pieces(text) if self._cuttable else [text]
      return [i for e in hf.encode_batch(pieces, add_special_tokens=False) for i in e.ids]
    if allow_special and self._extra:
      ids, rest = [], text
      while rest:
        hits = [(rest.find(t), t) for t in self._extra if rest.find(t) >= 0]
        if not hits:
          ids += self._sp.encode(rest)
          break
        pos, tok = min(hits)
        ids += self._sp.encode(rest[:pos]) + [self._extra[tok]]
        rest = rest[pos + len(tok):]
      return ids
    return self._sp.encode(text)

  def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
    """Text of ``ids``; special tokens are written out (``<eos>``) unless ``skip_special``."""
    ids = [int(i) for i in ids]
    if self._hf is not None:
      return self._hf.decode(ids, skip_special_tokens=skip_special)
    inverse = {v: k for k, v in self._extra.items()}
    out, run = [], []
    for i in ids:
      if i in inverse:
        out.append(self._sp.decode(run))
        run = []
        if not skip_special:
          out.append(inverse[i])
      else:
        run.append(i)
    out.append(self._sp.decode(run))
    return "".join(out)

  # -- persistence -----------------------------------------------------------------------------

  def to_json(self) -> str:
    """A JSON string that ``Tokenizer.from_json`` restores (stored in checkpoints)."""
    if self._hf is not None:
      return self._hf.to_str()
    return json.dumps({"sentencepiece_model": base64.b64encode(self._sp_proto).decode("ascii")})

  @classmethod
  def from_json(cls, text: str) -> Tokenizer:
    spec = json.loads(text)
    for key, make in JSON_FORMATS.items():
      if key in spec:
        return make(spec[key])
    if "sentencepiece_model" in spec:
      return cls(sp_model_proto=base64.b64decode(spec["sentencepiece_model"]))
    import tokenizers  # pylint: disable=g-import-not-at-top
    return cls(hf=tokenizers.Tokenizer.from_str(text))

  def save(self, path: str) -> None:
    """Writes ``to_json()`` to ``path`` atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(self.to_json())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # like the run's other outputs (mkstemp makes it 0600)
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str) -> Tokenizer:
    """Loads a ``tokenizer.json`` (HF or ours), a SentencePiece ``.model`` file, or with
    ``hf:DIR`` the tokenizer of the HF checkpoint directory DIR (``tokenizer_hf.py``).

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file is neither (named, with the parser's first line of complaint).
    """
    for prefix, make in PATH_PREFIXES.items():
      if path.startswith(prefix):
        return make(path[len(prefix):])
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file {path!r} does not exist (DataConfig.tokenizer "
                              "takes a tokenizer.json or a SentencePiece .model path, hf:DIR for "
                              "an HF checkpoint's tokenizer, or None to train a BPE on the data)")
    with open(path, "rb") as f:
      data = f.read()
    sp = path.endswith(".model") or not data.lstrip().startswith(b"{")
    try:
      return cls(sp_model_proto=data) if sp else cls.from_json(data.decode("utf-8"))
    except Exception as e:  # pylint: disable=broad-except  (each parser raises its own kind)
      why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
      raise ValueError(
          f"tokenizer file {path!r} (DataConfig.tokenizer) cannot be read as "
          + ("a SentencePiece .model" if sp else "a tokenizer.json") + f" ({why}); give a "
          "tokenizer.json or a SentencePiece .model, hf:DIR for an HF checkpoint's tokenizer, "
          "or None to train a BPE on the data") from None

  def __repr__(self) -> str:
    kind = "hf" if self._hf is not None else "sentencepiece"
    return f"Tokenizer({kind}, vocab_size={self.vocab_size}, fingerprint={self.fingerprint})"


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
  """Trains a byte-level BPE with the special tokens at ids 0..7.

  Args:
    texts: training text (bounded by the caller).
    vocab_size: total ids including the 8 special tokens and the 256 byte symbols.

  Raises:
    ValueError: ``vocab_size`` < 264 (a byte-level vocabulary needs every byte).
  """
  # pylint: disable=g-import-not-at-top
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  # pylint: enable=g-import-not-at-top
  minimum = len(SPECIAL_TOKENS) + _BYTE_ALPHABET
  if vocab_size < minimum:
    raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least {minimum} "
                     f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  hf.train_from_iterator(texts, trainer)
  return Tokenizer(hf=hf)


def _training_sample(data_cfg, max_bytes: int) -> Iterator[str]:
  """A bounded, deterministic sample of the training split (short-document view)."""
  source = splits.open_split(data_cfg.source, split="train",
                              eval_fraction=data_cfg.eval_fraction, long_documents=False,
                              eval_split=getattr(data_cfg, "eval_split", "auto"))
  order = np.random.default_rng(data_cfg.seed).permutation(len(source))
  total = 0
  for index in order.tolist():
    text = source.load(index)
    if text is None:
      continue
    text = text[:max_bytes - total]
    total += len(text)
    yield text
    if total >= max_bytes:
      return


def source_key(data_cfg) -> dict:
  """What a cached tokenizer is keyed by: the data source it was trained on (recorded beside
  it; a cache trained on another source is not reused, one trained on another held-out split
  or seed of the same source is)."""
  return {"source": data_cfg.source}


def _cache_paths(workdir: str, key: dict) -> list[str]:
  """Where a tokenizer for `key` may be cached: `tokenizer.json` (the workdir's first one),
  then `tokenizer-<hash of key>.json`."""
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  return [os.path.join(workdir, TOKENIZER_FILENAME),
          os.path.join(workdir, f"tokenizer-{digest}.json")]


def _key_path(cache: str) -> str:
  return cache[:-len(".json")] + ".source.json"


def _cached_for(cache: str, key: dict) -> bool:
  """The tokenizer at `cache` exists and was trained on `key`'s data (a cache without a
  recorded key predates keys and is taken to be)."""
  if not os.path.isfile(cache):
    return False
  try:
    with open(_key_path(cache), encoding="utf-8") as f:
      return json.load(f) == key
  except FileNotFoundError:
    return True


def is_degenerate(tok: Tokenizer) -> bool:
  """A BPE that learned no merge (bytes and special tokens only): trained on no text."""
  return tok.vocab_size <= len(SPECIAL_TOKENS) + _BYTE_ALPHABET


def load_or_train_tokenizer(data_cfg, workdir: str | None, vocab_size: int) -> Tokenizer:
  """The run's tokenizer: given, cached in ``workdir``, or trained now and cached.

  Order: ``data_cfg.tokenizer`` (a path) if set; else the workdir's cached tokenizer for this
  source (``tokenizer.json``, or ``tokenizer-<key>.json`` when the workdir's first tokenizer
  was trained on another source; ``source_key`` is recorded beside it); else a byte-level BPE
  trained on ~8 MB of the training split (a few seconds) and cached there. A tokenizer that
  learned no merge (no training text) is never cached.

  Args:
    data_cfg: a ``DataConfig`` (``source``, ``tokenizer``, ``eval_fraction``, ``seed``).
    workdir: run directory (None: train without caching).
    vocab_size: the model's vocabulary size; the tokenizer's ``vocab_size`` must not exceed it.

  Raises:
    ValueError: the tokenizer's vocabulary is larger than ``vocab_size`` (a cached one: delete
      it or use a fresh workdir).
    FileNotFoundError: ``data_cfg.tokenizer`` does not exist, or the data source is missing.
  """
  if data_cfg.tokenizer is not None:
    tok = Tokenizer.load(data_cfg.tokenizer)
    if tok.vocab_size > vocab_size:
      raise ValueError(f"tokenizer {data_cfg.tokenizer!r} has {tok.vocab_size} ids but the model "
                       f"vocab_size is {vocab_size}; raise ModelConfig.vocab_size")
    image = SPECIAL_TOKENS.index("<image>")
    if getattr(data_cfg, "images", "") and tok.image_id != image:
      raise ValueError(f"DataConfig.images={data_cfg.images!r} needs '<image>' at id {image} (the "
                       f"model's placeholder id), but tokenizer {data_cfg.tokenizer!r} has it at "
                       f"{tok.image_id}; use a tokenizer trained here, or text only "
                       "(--set data.images='')")
    return tok
  key = source_key(data_cfg)
  paths = _cache_paths(workdir, key) if workdir else []
  for cache in paths:
    if _cached_for(cache, key):
      tok = Tokenizer.load(cache)
      if tok.vocab_size > vocab_size:
        raise ValueError(f"cached tokenizer {cache!r} has {tok.vocab_size} ids but the model "
                         f"vocab_size is {vocab_size}; delete it or use another workdir")
      if tok.vocab_size < vocab_size:
        _log.warning("tokenizer: cached %s has %d ids (< model vocab_size %d)", cache,
                     tok.vocab_size, vocab_size)
      _log.info("tokenizer: reusing %s (%s)", cache, tok.fingerprint)
      return tok
  start = time.perf_counter()
  tok = train_bpe(_training_sample(data_cfg, TOKENIZER_SAMPLE_BYTES), vocab_size)
  _log.info("tokenizer: trained byte-level BPE (vocab %d) on %s in %.1f s, fingerprint %s",
            vocab_size, data_cfg.source, time.perf_counter() - start, tok.fingerprint)
  if is_degenerate(tok):
    _log.warning("tokenizer: %s gave no training text, so the BPE learned no merge; it is "
                 "not cached (fix the data and rerun)", data_cfg.source)
    return tok
  if paths:
    cache = paths[0] if not os.path.isfile(paths[0]) else paths[1]
    tok.save(cache)
    with open(_key_path(cache), "w", encoding="utf-8") as f:
      json.dump(key, f)
  return tok
