"""Captioning demo: train the tiny multimodal model on an image-caption + text mix on CPU.

  python -m experiments.vision_demo --preset=tiny            # ~minutes on 2 CPU cores

Data (no downloads): scikit-learn's handwritten digits (caption: the digit) and words rendered
with matplotlib's DejaVu fonts (caption: the word), mixed with standard-library text, packed by
the Grain pipeline (several images and their captions per row, `sparse_lm.data.images`). The
model is the `tiny` preset with a tiny ViT (`vision.TINY_VISION`). After training it reports
held-out captioning accuracy: an example counts when the greedy caption equals the reference
exactly (all caption tokens and the end-of-sequence token; computed teacher-forced, which for
greedy decoding is the same test), and prints a few held-out images as ASCII art with their
greedy captions (decoded token by token).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from sparse_lm import vision
from sparse_lm.data import DataConfig, load_or_train_tokenizer, make_train_iterator
from sparse_lm.data import image_sources, images as image_data
from sparse_lm.train.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """What the demo trains (the `tiny` preset's numbers; see `--help`)."""
  images: str = "digits+words"
  image_ratio: float = 0.9
  seq_len: int = 64
  patches_per_row: int = 64
  batch_size: int = 16
  steps: int = 700
  peak_lr: float = 3e-3
  warmup_steps: int = 50
  eval_examples: int = 200
  show: int = 4
  seed: int = 0
  # The tiny preset cut to 3 layers (KDA, MLA, MLA: every mixer, the dense FFN and LatentMoE,
  # AttnRes) so that it compiles and steps in minutes on 2 shared CPU cores.
  model_overrides: tuple = (("num_layers", 3), ("mla_every", 2), ("attnres_block_layers", 2))


PRESETS = {"tiny": DemoConfig()}


def ascii_art(image: np.ndarray, width: int = 24) -> str:
  """uint8 [h, w, 3] -> lines of characters, dark pixels dense (' .:-=+*#%@' by luminance)."""
  ramp = " .:-=+*#%@"
  g = image.astype(np.float32).mean(-1)
  h, w = g.shape
  step = max(1, w // width)
  g = g[::step * 2, ::step] if h > 2 else g
  if g.mean() > 127:  # dark ink on light paper: ink dense
    g = 255 - g
  idx = np.clip((g / 256 * len(ramp)).astype(int), 0, len(ramp) - 1)
  return "\n".join("".join(ramp[i] for i in row) for row in idx)


def _model_factory(cfg):
  from flax import nnx
  from sparse_lm.model.transformer import Transformer
  return lambda seed: Transformer(cfg, rngs=nnx.Rngs(seed))


def _eval_rows(examples, tok, demo: DemoConfig, patch_size: int):
  """One held-out example per row: (batch dict, [(start, end) of caption+eos targets])."""
  B = len(examples)
  T, L = demo.seq_len, demo.patches_per_row
  tokens = np.zeros((B, T), np.int32)
  packed = vision.PackedImages(np.zeros((B, L, patch_size * patch_size * 3), np.uint8),
                               np.zeros((B, L), np.int32), np.zeros((B, L, 2), np.int32))
  spans = []
  for b, (image, caption) in enumerate(examples):
    ex = image_data.example(image, tok.encode(caption), patch_size=patch_size, bos_id=tok.bos_id,
                            eos_id=tok.eos_id, image_token_id=vision.IMAGE_TOKEN_ID)
    n = len(ex["tokens"])
    tokens[b, :n] = ex["tokens"]
    m = len(ex["patches"])
    packed.patches[b, :m], packed.coords[b, :m] = ex["patches"], ex["patch_coords"]
    packed.segment_ids[b, :m] = 1
    n_img = m // 4
    spans.append((1 + n_img, n))  # caption tokens and <eos> are targets 1+n_img .. n-1
  seg = (tokens != 0).astype(np.int32)
  return {"tokens": tokens, "segment_ids": seg, "images": packed}, spans


def evaluate(graphdef, state, examples, tok, demo, patch_size):
  """(exact-match accuracy, greedy captions) of held-out (image, caption) examples.

  Accuracy: an example counts when every caption token and <eos> is the model's argmax given
  the reference before it (teacher-forced; for greedy decoding the same test). Captions:
  greedy decoding, each token fed back, up to <eos> or 4 tokens past the reference's length
  (a full forward pass per token on the fixed-size rows: no cache, one compile)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  batch, spans = _eval_rows(examples, tok, demo, patch_size)
  images = jax.tree.map(jnp.asarray, batch["images"])

  @jax.jit
  def predict(params, model_vars, tokens, images):
    model = nnx.merge(graphdef, params, model_vars)
    seg = (tokens != 0).astype(jnp.int32)
    return jnp.argmax(model(tokens, segment_ids=seg, images=images), -1)

  pred = np.asarray(predict(state.params, state.model_vars, batch["tokens"], images))
  correct = [bool(np.array_equal(batch["tokens"][b, s:e], pred[b, s - 1:e - 1]))
             for b, (s, e) in enumerate(spans)]  # position t predicts t + 1
  T = batch["tokens"].shape[1]
  tokens = batch["tokens"].copy()
  for b, (s, _) in enumerate(spans):
    tokens[b, s:] = 0  # the prompt: <bos> and the image tokens
  ends = [min(T, e + 4) for _, e in spans]
  done = [False] * len(spans)
  for j in range(max(e - s for (s, _), e in zip(spans, ends))):
    nxt = np.asarray(predict(state.params, state.model_vars, tokens, images))
    for b, (s, _) in enumerate(spans):
      t = s + j
      if done[b] or t >= ends[b]:
        done[b] = True
        continue
      tokens[b, t] = nxt[b, t - 1]
      done[b] = int(tokens[b, t]) == tok.eos_id
  captions = []
  for b, (s, _) in enumerate(spans):
    out = [int(t) for t in tokens[b, s:ends[b]]]
    captions.append(tok.decode(out[:out.index(tok.eos_id)] if tok.eos_id in out else out))
  return float(np.mean(correct)), captions


def heldout(spec: str, n: int, seed: int):
  src = image_sources.open_images(spec, split="eval", eval_fraction=0.1)
  rng = np.random.default_rng(seed)
  idx = rng.permutation(len(src))[:n]
  return [x for x in (src.load(int(i)) for i in idx) if x is not None]


def train(demo: DemoConfig, workdir: str, log=print):
  """Train the demo model; returns (graphdef, state, tokenizer, model config, seconds)."""
  import jax
  from sparse_lm.model.loss import loss_fn
  from sparse_lm.train.optimizer import make_optimizer, wsd_schedule
  from sparse_lm.train.state import graphdef_of, make_init_fn
  from sparse_lm.train.step import make_train_step

  t0 = time.perf_counter()
  cfg = vision.tiny_vision_config(**dict(demo.model_overrides))
  data_cfg = DataConfig(images=demo.images, image_ratio=demo.image_ratio, eval_fraction=0.1,
                        image_patches_per_row=demo.patches_per_row, seed=demo.seed)
  os.makedirs(workdir, exist_ok=True)
  tok = load_or_train_tokenizer(DataConfig(), workdir, cfg.vocab_size)
  it = make_train_iterator(data_cfg, tok, seq_len=demo.seq_len, batch_size=demo.batch_size,
                           patch_size=cfg.vision_patch_size)
  optim = OptimizerConfig(peak_lr=demo.peak_lr, warmup_steps=demo.warmup_steps,
                          decay_fraction=0.3, weight_decay=0.01)
  tx = make_optimizer(optim, demo.steps)
  factory = _model_factory(cfg)
  graphdef = graphdef_of(factory, demo.seed)
  state = make_init_fn(factory, tx, demo.seed)()
  step = jax.jit(make_train_step(graphdef, tx, wsd_schedule(optim, demo.steps), loss_fn,
                                 z_loss_coef=1e-4), donate_argnums=0)
  log(f"vision demo: tiny preset + tiny ViT, {demo.images} = {demo.image_ratio:.0%} of the "
      f"packed documents, with stdlib text; {demo.batch_size} rows x {demo.seq_len} tokens "
      f"(+{demo.patches_per_row} patch slots), {demo.steps} steps")
  for i in range(demo.steps):
    batch = {k: v for k, v in next(it).items() if k != "positions"}
    state, m = step(state, batch)
    if i % 50 == 0 or i == demo.steps - 1:
      log(f"  step {i:4d}  loss {float(m['loss']):.3f}  ({time.perf_counter() - t0:.0f} s)")
  it.close()
  return graphdef, state, tok, cfg, time.perf_counter() - t0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.vision_demo",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--workdir", default="runs/vision_demo")
  args = parser.parse_args(argv)
  if args.steps is not None and args.steps < 1:
    parser.error(f"--steps={args.steps} must be >= 1")
  if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
    parser.error(f"--workdir={args.workdir} is a file; give a directory (it holds the "
                 "tokenizer)")
  demo = PRESETS[args.preset]
  if args.steps is not None:
    demo = dataclasses.replace(demo, steps=args.steps)
  t0 = time.perf_counter()
  graphdef, state, tok, cfg, train_s = train(demo, args.workdir,
                                             log=lambda m: print(m, flush=True))
  for name in ("digits", "words"):
    examples = heldout(name, demo.eval_examples, demo.seed)
    acc, captions = evaluate(graphdef, state, examples, tok, demo, cfg.vision_patch_size)
    chance = 0.1 if name == "digits" else 1.0 / len(image_sources.word_list())
    print(f"held-out {name}: exact-caption accuracy {acc:.1%} on {len(examples)} images "
          f"(chance {chance:.1%})")
    for (image, caption), got in list(zip(examples, captions))[:demo.show]:
      print(ascii_art(image))
      print(f"  reference {caption!r}  generated {got!r}\n")
  print(f"trained in {train_s:.0f} s; total {time.perf_counter() - t0:.0f} s "
        f"({os.cpu_count()} CPUs visible, load average {os.getloadavg()[0]:.1f})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
