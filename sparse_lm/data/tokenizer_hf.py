"""The tokenizer that ships with a Hugging Face checkpoint (``DataConfig.tokenizer="hf:DIR"``).

A checkpoint directory holds one of
  ``tokenizer.json``   an HF ``tokenizers`` model (encoded and decoded by that library), or
  ``tiktoken.model``   a Kimi-style tiktoken BPE: one ``<base64 bytes> <rank>`` line per token,
                       split by Kimi's pre-tokenizer pattern (``KIMI_PATTERN``), encoded and
                       decoded by ``tiktoken``;
beside ``tokenizer_config.json`` (special tokens: ``added_tokens_decoder`` {id: {"content"}} and
the ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` names) and ``config.json``
(``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``, used where tokenizer_config.json names
no token). The checkpoint's ids are kept as they are (a model trained on them needs them): no
token is added, and our roles map onto its tokens,
  ``<bos>`` = its bos token, ``<eos>`` = its eos token, ``<pad>`` = its pad token,
while the roles it has no token for (``<image>``, the tool-call tokens, and ``<pad>`` without a
pad token) have id None: the vision and agentic-RL stages need a tokenizer that has them. The
data pipeline still pads packed rows with id 0; those positions have ``segment_ids`` 0 and
``loss_mask`` 0, so the id there is never a target and never attended to across documents.

``HFCheckpointTokenizer`` is a ``Tokenizer`` (same encode/decode/fingerprint/to_json contract);
``to_json`` embeds the files' content, so checkpoints carry it and ``Tokenizer.from_json``
restores it without the directory.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import pathlib
from collections.abc import Sequence

from sparse_lm.data.tokenizer import JSON_FORMATS, PATH_PREFIXES, SPECIAL_TOKENS, Tokenizer

# The split pattern of Moonshot's tokenization_kimi.py (Kimi-K2 / Kimi-Linear / Kimi-K3): Han
# runs, letter runs without Han (class intersection `&&`), up to 3 digits, punctuation, spaces.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
PREFIX = "hf:"
_ROLE_KEYS = {"<bos>": "bos", "<eos>": "eos", "<pad>": "pad"}


def _token_name(value) -> str | None:
  """tokenizer_config.json spells a token as "text" or {"content": "text", ...}."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def _read_json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from e


def parse_tiktoken_ranks(text: str, where: str = "tiktoken.model") -> dict[bytes, int]:
  """The text of a ``tiktoken.model`` file -> {token bytes: rank (= id)}.

  Raises:
    ValueError: a malformed line or a repeated rank (``where`` and the line number named).
  """
  ranks: dict[bytes, int] = {}
  seen: set[int] = set()
  for n, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      token, rank = line.split()
      ranks[base64.b64decode(token, validate=True)] = int(rank)
    except ValueError as e:
      raise ValueError(f"{where}:{n}: expected '<base64 token> <rank>', got {line[:60]!r}") from e
    if int(rank) in seen:
      raise ValueError(f"{where}:{n}: rank {int(rank)} appears twice")
    seen.add(int(rank))
  if not ranks:
    raise ValueError(f"{where}: no tokens")
  return ranks


def read_checkpoint_spec(directory) -> dict:
  """The JSON-able description of a checkpoint directory's tokenizer (see module docstring):
  {"kind": "tokenizers"|"tiktoken", "tokenizer_json" or "ranks" (the tiktoken.model text),
  "pattern", "special_tokens" {text: id}, "roles" {"bos"/"eos"/"pad": id or None}}.

  Raises:
    FileNotFoundError: the directory, or both tokenizer.json and tiktoken.model, are missing.
    ValueError: a file is malformed, or a role names a token that is not in the vocabulary
      (the file and key are named).
  """
  d = pathlib.Path(directory)
  if not d.is_dir():
    raise FileNotFoundError(f"DataConfig.tokenizer={PREFIX}{directory}: {d} is not a directory "
                            "(give an HF checkpoint directory holding tokenizer.json or "
                            "tiktoken.model)")
  conf_path = d / "tokenizer_config.json"
  conf = _read_json(conf_path) if conf_path.is_file() else {}
  model_conf = _read_json(d / "config.json") if (d / "config.json").is_file() else {}
  model_conf = model_conf.get("text_config", model_conf)
  special = {}
  for key, entry in (conf.get("added_tokens_decoder") or {}).items():
    name = _token_name(entry)
    if name is None or not str(key).isdigit():
      raise ValueError(f"{conf_path}: added_tokens_decoder[{key!r}] must map an integer id to "
                       f"{{'content': text}}, got {entry!r}")
    special[name] = int(key)
  if (d / "tokenizer.json").is_file():
    spec = {"kind": "tokenizers", "tokenizer_json": (d / "tokenizer.json").read_text("utf-8")}
    parsed = _read_json(d / "tokenizer.json")
    special.update({t["content"]: int(t["id"]) for t in parsed.get("added_tokens") or []})
    vocab = (parsed.get("model") or {}).get("vocab") or {}
    known = {**(vocab if isinstance(vocab, dict) else {}), **special}
  elif (d / "tiktoken.model").is_file():
    ranks_text = (d / "tiktoken.model").read_text("ascii")
    ranks = parse_tiktoken_ranks(ranks_text, str(d / "tiktoken.model"))
    clash = sorted(i for i in special.values() if i < len(ranks))
    if clash:
      raise ValueError(f"{conf_path}: added_tokens_decoder ids {clash[:5]} overlap the "
                       f"{len(ranks)} BPE ranks of {d / 'tiktoken.model'}")
    spec = {"kind": "tiktoken", "ranks": ranks_text, "pattern": KIMI_PATTERN}
    known = special
  else:
    raise FileNotFoundError(f"DataConfig.tokenizer={PREFIX}{directory}: {d} has neither "
                            "tokenizer.json nor tiktoken.model")
  roles = {}
  for role in ("bos", "eos", "pad"):
    name = _token_name(conf.get(f"{role}_token"))
    if name is not None:
      if name not in known:
        raise ValueError(f"{conf_path}: {role}_token {name!r} is not a token of the vocabulary "
                         "(add it to added_tokens_decoder or fix the name)")
      roles[role] = known[name]
    else:
      value = model_conf.get(f"{role}_token_id")
      roles[role] = value[0] if isinstance(value, list) and value else value
  for role in ("bos", "eos"):
    if roles[role] is None:
      raise ValueError(f"{d}: no {role} token (tokenizer_config.json {role}_token, or "
                       f"config.json {role}_token_id); the data pipeline wraps every document "
                       "in <bos> ... <eos>")
  spec.update(special_tokens=special, roles=roles)
  return spec


class HFCheckpointTokenizer(Tokenizer):
  """A checkpoint's own tokenizer (``read_checkpoint_spec``), behind the ``Tokenizer`` API."""

  def __init__(self, spec: dict):  # pylint: disable=super-init-not-called
    self._spec = spec
    self._roles = {f"<{k}>": v for k, v in spec["roles"].items()}
    self._special = dict(spec["special_tokens"])
    if spec["kind"] == "tokenizers":
      import tokenizers  # pylint: disable=g-import-not-at-top
      self._lib = tokenizers.Tokenizer.from_str(spec["tokenizer_json"])
      self._lib_raw = tokenizers.Tokenizer.from_str(spec["tokenizer_json"])
      self._lib_raw.encode_special_tokens = True  # special-token strings stay text
      self._size = self._lib.get_vocab_size(with_added_tokens=True)
    elif spec["kind"] == "tiktoken":
      import tiktoken  # pylint: disable=g-import-not-at-top
      ranks = parse_tiktoken_ranks(spec["ranks"])
      self._lib = tiktoken.Encoding(name="hf_checkpoint", pat_str=spec["pattern"],
                                    mergeable_ranks=ranks, special_tokens=self._special)
      self._size = self._lib.n_vocab
      # A byte-level BPE encodes any text only if every byte is a token; tiktoken panics
      # (a Rust PanicException, not an Exception) on a byte it has no rank for.
      self._missing_bytes = frozenset(range(256)) - {t[0] for t in ranks if len(t) == 1}
    else:
      raise ValueError(f"unknown checkpoint tokenizer kind {spec['kind']!r}")

  @classmethod
  def from_directory(cls, directory) -> HFCheckpointTokenizer:
    """The tokenizer of an HF checkpoint directory (errors: ``read_checkpoint_spec``)."""
    return cls(read_checkpoint_spec(directory))

  def token_to_id(self, token: str) -> int | None:
    if token in SPECIAL_TOKENS:  # our roles: the checkpoint's bos/eos/pad, else none
      return self._roles.get(token)
    if token in self._special:
      return self._special[token]
    if self._spec["kind"] == "tokenizers":
      return self._lib.token_to_id(token)
    try:
      return self._lib.encode_single_token(token.encode("utf-8"))
    except KeyError:
      return None

  @property
  def vocab_size(self) -> int:
    """Number of ids (largest id + 1, special tokens included)."""
    return self._size

  @functools.cached_property
  def fingerprint(self) -> str:
    return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()[:16]

  def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
    """Token ids of ``text`` exactly as the checkpoint's library encodes it (no bos/eos added;
    special-token strings in ``text`` are plain characters unless ``allow_special``)."""
    if self._spec["kind"] == "tokenizers":
      lib = self._lib if allow_special else self._lib_raw
      return lib.encode(text, add_special_tokens=False).ids
    if self._missing_bytes:
      bad = self._missing_bytes.intersection(text.encode("utf-8"))
      if bad:
        raise ValueError(
            f"the checkpoint's tiktoken ranks have no token for the byte(s) "
            f"{', '.join(f'0x{b:02x}' for b in sorted(bad)[:5])} of this text ("
            f"{len(self._missing_bytes)} of the 256 single bytes are missing), so it cannot "
            "be encoded: use a tokenizer whose ranks hold every byte, or text without them")
    if allow_special:
      return self._lib.encode(text, allowed_special="all")
    return self._lib.encode(text, disallowed_special=())

  def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
    """Text of ``ids`` as the library decodes them (special tokens dropped if
    ``skip_special``)."""
    ids = [int(i) for i in ids]
    if self._spec["kind"] == "tokenizers":
      return self._lib.decode(ids, skip_special_tokens=skip_special)
    if skip_special:
      specials = set(self._special.values())
      ids = [i for i in ids if i not in specials]
    return self._lib.decode(ids)

  def to_json(self) -> str:
    return json.dumps({"hf_checkpoint_tokenizer": self._spec}, sort_keys=True,
                      ensure_ascii=False)

  def __repr__(self) -> str:
    return (f"HFCheckpointTokenizer({self._spec['kind']}, vocab_size={self.vocab_size}, "
            f"fingerprint={self.fingerprint})")


JSON_FORMATS["hf_checkpoint_tokenizer"] = HFCheckpointTokenizer

def write_checkpoint_files(tokenizer: Tokenizer, directory) -> dict[str, int | None]:
  """Write ``tokenizer`` as an HF checkpoint directory's tokenizer files, the inverse of
  ``read_checkpoint_spec``: ``tokenizer.json`` (or ``tiktoken.model`` for a tiktoken
  checkpoint tokenizer) and ``tokenizer_config.json`` (``added_tokens_decoder`` and the
  ``bos_token`` / ``eos_token`` / ``pad_token`` names), so that ``transformers`` and
  ``sparse_lm.interop.hf import`` read the same ids back.

  Args:
    tokenizer: our BPE (an HF ``tokenizers`` model) or an ``HFCheckpointTokenizer``.
    directory: the export directory (created if missing).

  Returns:
    {"bos_token_id", "eos_token_id", "pad_token_id"} for config.json (None where the
    tokenizer has no such token).

  Raises:
    ValueError: a SentencePiece tokenizer (no HF ``tokenizers`` file to write: export the
      model without it, or train with a ``tokenizers`` BPE).
  """
  d = pathlib.Path(directory)
  d.mkdir(parents=True, exist_ok=True)
  roles = {role: tokenizer.token_to_id(name) for name, role in _ROLE_KEYS.items()}
  if isinstance(tokenizer, HFCheckpointTokenizer):
    spec = tokenizer._spec  # pylint: disable=protected-access
    special = dict(spec["special_tokens"])
    if spec["kind"] == "tokenizers":
      (d / "tokenizer.json").write_text(spec["tokenizer_json"], encoding="utf-8")
    else:
      (d / "tiktoken.model").write_text(spec["ranks"], encoding="ascii")
  else:
    text = tokenizer.to_json()
    if "sentencepiece_model" in json.loads(text):
      raise ValueError("a SentencePiece tokenizer has no HF tokenizer.json to export; export "
                       "the weights without it or train with the default BPE tokenizer")
    (d / "tokenizer.json").write_text(text, encoding="utf-8")
    special = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS
               if tokenizer.token_to_id(t) is not None}
  by_id = {i: t for t, i in special.items()}
  names = {role: by_id.get(i) for role, i in roles.items()}
  conf = {"added_tokens_decoder": {str(i): {"content": t, "special": True}
                                   for t, i in sorted(special.items(), key=lambda x: x[1])},
          **{f"{role}_token": name for role, name in names.items() if name is not None}}
  if (d / "tokenizer.json").is_file():
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
  (d / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")
  return {f"{role}_token_id": i for role, i in roles.items()}

PATH_PREFIXES[PREFIX] = HFCheckpointTokenizer.from_directory
