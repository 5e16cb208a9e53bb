"""Write the two tiny checkpoint tokenizers the interop tests use (no download):

  tokenizer_tiktoken/  tiktoken.model + tokenizer_config.json, Kimi's layout: BPE ranks learned
                       here from the printable-ASCII bytes, then a block of special tokens up to
                       id 255 ([BOS], [EOS], <|im_end|>, ..., reserved names, [PAD] last), so
                       the vocabulary is exactly the 256 ids of kimi_linear_tiny's model;
  tokenizer_json/      tokenizer.json (an HF `tokenizers` byte-level BPE of 300 ids trained here)
                       + tokenizer_config.json naming <s>, </s>, <pad>.

    python tests/data/hf/make_tokenizer_fixtures.py tests/data/hf

The BPE below is the textbook one (count adjacent pairs inside each pre-token, merge the most
frequent, ties by the smaller pair): a rank is the order a token was learned, as tiktoken wants.
"""

import base64
import collections
import json
import pathlib
import sys

import regex
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from sparse_lm.data.tokenizer_hf import KIMI_PATTERN

TEXT = """The quick brown fox jumps over the lazy dog. A tokenizer splits text into pieces;
the model sees their ids. def train(model, data):\n    for step in range(100):\n        loss =
model(data)\n    return loss\nKimi Linear mixes KDA layers with MLA layers, and the experts of
its mixture are chosen by a sigmoid router. Researchers start from public weights, so the
tokenizer that ships with a checkpoint must give the same ids as the one it was trained with.
""" * 3
NUM_MERGES = 120
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
            "<|tool_call_begin|>", "<|tool_call_end|>", "[UNK]"]


def learn_ranks(text: str, num_merges: int) -> dict[bytes, int]:
  alphabet = sorted({bytes([b]) for b in range(32, 127)} | {b"\n", b"\t"})
  ranks = {t: i for i, t in enumerate(alphabet)}
  words = collections.Counter(tuple(bytes([b]) for b in w.encode())
                              for w in regex.findall(KIMI_PATTERN, text, flags=regex.V1))
  for _ in range(num_merges):
    pairs = collections.Counter()
    for w, n in words.items():
      for a, b in zip(w, w[1:]):
        pairs[a, b] += n
    if not pairs:
      break
    (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
    ranks[a + b] = len(ranks)
    merged = collections.Counter()
    for w, n in words.items():
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
          out.append(a + b)
          i += 2
        else:
          out.append(w[i])
          i += 1
      merged[tuple(out)] += n
    words = merged
  return ranks


def write_tiktoken(out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  ranks = learn_ranks(TEXT, NUM_MERGES)
  lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(),
                                                                     key=lambda kv: kv[1])]
  (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
  names = SPECIALS + [f"<|reserved_token_{i}|>" for i in range(256 - len(ranks) - 9)] + ["[PAD]"]
  decoder = {str(len(ranks) + i): {"content": n, "special": True} for i, n in enumerate(names)}
  conf = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
          "pad_token": "[PAD]", "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer"}
  (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")


def write_tokenizer_json(out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  hf.train_from_iterator([TEXT], trainer)
  hf.save(str(out / "tokenizer.json"))
  conf = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
          "tokenizer_class": "PreTrainedTokenizerFast"}
  (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")


if __name__ == "__main__":
  root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent)
  write_tiktoken(root / "tokenizer_tiktoken")
  write_tokenizer_json(root / "tokenizer_json")
  print("wrote", root / "tokenizer_tiktoken", root / "tokenizer_json")
