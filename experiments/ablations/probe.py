"""Probes of a finished ablation run: forward passes of its saved parameters on held-out text.

Every number comes from the run's checkpoints (`load_at`) and the held-out split of its data
source (the installed corpus; `heldout_rows`):
  - `gate_exponents`: per KDA layer, the largest exponent the dense diagonal-tile path would
    meet (`pallas_kernels.kda.tiles.dense_diag_max_exponent` of that layer's decay gates g);
  - `ffn_activation_max`: per FFN call (dense FFN, shared expert, routed experts, in execution
    order), the largest |h| of the GLU hidden activation h = act(x W_g) * (x W_u);
  - `moe_load`: per MoE layer, max/mean expert load of the routing summed over many held-out
    tokens (the final router and balancer bias; less sampling noise than one training batch):
    the first LOAD_PROBE_TOKENS tokens (a multiple of L) of each of up to 32 held-out documents,
    as rows of L, so runs of different L route the same tokens;
  - `position_losses`: held-out loss per position bucket [0, L), [L, 2L), [2L, 4L), [4L, 8L)
    of single-document rows of 8L tokens, and the mean loss over the first nL positions;
  - `passkey`: retrieval accuracy of a 5-digit pass key hidden at a depth of real held-out text.
Per-call values are read with `record_calls` (a temporary wrapper around a module function
that sends one scalar per call to the host in order: under the scanned layer groups one call
runs per layer).
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

LOAD_PROBE_TOKENS = 128  # held-out tokens per document for `moe_load` (rows of L within them)


def checkpoint_steps(run_dir: pathlib.Path, stage: str = "stage_8k") -> list[int]:
  d = pathlib.Path(run_dir) / stage / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def load_at(run_dir: pathlib.Path, step: int, stage: str = "stage_8k"):
  """(model, tokenizer, stage_config) of checkpoint `step` of `run_dir` (like
  `sparse_lm.train.load`, which reads only the newest)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from sparse_lm import sharding as shd  # pylint: disable=g-import-not-at-top
  from sparse_lm.data import Tokenizer  # pylint: disable=g-import-not-at-top
  from sparse_lm.train.builder import build  # pylint: disable=g-import-not-at-top
  from sparse_lm.train.checkpoint import Checkpointer, stage_from_json  # pylint: disable=g-import-not-at-top
  ckpt = Checkpointer(pathlib.Path(run_dir) / stage / "checkpoints", keep=10**6)
  try:
    meta = ckpt.read_meta(step)
    stage_cfg = stage_from_json(meta["stage"])
    mesh = shd.make_mesh(shd.MeshLayout())
    parts = build(stage_cfg, mesh)
    with shd.use_mesh(mesh):
      target = shd.with_shardings(parts.abstract_state, parts.state_shardings)
      restored = ckpt._mgr.restore(step, args=ocp.args.Composite(  # pylint: disable=protected-access
          state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
  finally:
    ckpt.close()
  state = restored.state
  model = nnx.merge(parts.graphdef, state.params, state.model_vars)
  return model, Tokenizer.from_json(meta["tokenizer"]["json"]), stage_cfg


def has_cpu_platform() -> bool:
  """Whether JAX initialised its CPU platform (host callbacks run through it)."""
  try:
    return bool(jax.devices("cpu"))
  except RuntimeError:
    return False


@contextlib.contextmanager
def record_calls(module, name: str, stat: Callable[..., jax.Array], out: list):
  """Within the block, `module.name(*args)` also appends `float(stat(result, *args))` to `out`
  (in execution order, through an ordered host callback).

  Raises:
    RuntimeError: the CPU platform is not initialised (JAX_PLATFORMS=cuda or tpu alone): JAX
      runs host callbacks through it, so list it too (JAX_PLATFORMS=cuda,cpu).
  """
  if not has_cpu_platform():
    raise RuntimeError("record_calls: jax.debug.callback needs the CPU platform; run with "
                       "JAX_PLATFORMS=cuda,cpu (the accelerator and cpu)")
  orig = getattr(module, name)

  def wrapped(*args, **kwargs):
    result = orig(*args, **kwargs)
    jax.debug.callback(lambda v: out.append(float(v)), stat(result, *args, **kwargs),
                       ordered=True)
    return result

  setattr(module, name, wrapped)
  try:
    yield out
  finally:
    setattr(module, name, orig)


def heldout_rows(stage, tokenizer, length: int, max_rows: int) -> np.ndarray:
  """[n <= max_rows, length] int32: the first `length` tokens of each held-out document of the
  stage's source that has that many (documents in id order)."""
  from sparse_lm.data import splits  # pylint: disable=g-import-not-at-top
  d = stage.data
  src = splits.open_split(d.source, split="eval", eval_fraction=d.eval_fraction,
                          long_documents=d.long_documents, eval_split=d.eval_split)
  rows = []
  for i in range(len(src)):
    text = src.load(i)
    if not text:
      continue
    ids = tokenizer.encode(text)
    if len(ids) >= length:
      rows.append(ids[:length])
    if len(rows) == max_rows:
      break
  if not rows:
    raise ValueError(f"no held-out document of {d.source!r} has {length} tokens")
  return np.asarray(rows, np.int32)


def load_rows(stage, tokenizer, length: int, max_docs: int = 32) -> np.ndarray:
  """[n, length] int32: the first max(length, LOAD_PROBE_TOKENS // length * length) tokens of
  each of up to `max_docs` held-out documents (`heldout_rows`), cut into rows of `length`, so
  runs trained at different lengths route the same tokens (128 per document at length <= 128)."""
  per_doc = max(1, LOAD_PROBE_TOKENS // length)
  return heldout_rows(stage, tokenizer, per_doc * length, max_docs).reshape(-1, length)


def gate_exponents(model, tokens: np.ndarray) -> list[float]:
  """Per KDA layer (execution order): `dense_diag_max_exponent` of its gates on `tokens`."""
  from pallas_kernels.kda.tiles import dense_diag_max_exponent  # pylint: disable=g-import-not-at-top
  from sparse_lm.model import kda  # pylint: disable=g-import-not-at-top
  chunk = model.cfg.kda_chunk_size
  out: list[float] = []
  stat = lambda g, *a, **k: dense_diag_max_exponent(g, chunk_size=chunk)
  with record_calls(kda, "kda_gate", stat, out):
    jax.block_until_ready(model.forward_hidden(jnp.asarray(tokens))[0])
  jax.effects_barrier()
  return out


def ffn_activation_max(model, tokens: np.ndarray) -> list[float]:
  """Per GLU call (execution order): max |h| of its hidden activation on `tokens`."""
  import importlib  # pylint: disable=g-import-not-at-top
  situ_glu = importlib.import_module("sparse_lm.moe.situ_glu")  # the module, not the function
  out: list[float] = []
  with record_calls(situ_glu, "_situ", lambda h, *a, **k: jnp.max(jnp.abs(h)), out):
    jax.block_until_ready(model.forward_hidden(jnp.asarray(tokens))[0])
  jax.effects_barrier()
  return out


def moe_load(model, tokens: np.ndarray, batch: int = 8) -> list[float]:
  """Per MoE layer: max/mean expert load of the assignments of all `tokens` (summed)."""
  fwd = jax.jit(lambda t: model.forward_hidden(t)[1]["load"])
  total = None
  for i in range(0, len(tokens), batch):
    load = np.asarray(fwd(jnp.asarray(tokens[i:i + batch])), np.float64)  # [layers, E]
    total = load if total is None else total + load
  return [float(x) for x in total.max(-1) / total.mean(-1)]


def token_losses(logits_fn, tokens: np.ndarray, batch: int = 4) -> np.ndarray:
  """[n, T - 1] next-token cross-entropy (nats) of the rows of `tokens`; `logits_fn`: tokens
  [B, T] -> logits [B, T, V] (e.g. a jitted model)."""
  fwd = logits_fn
  out = []
  for i in range(0, len(tokens), batch):
    t = jnp.asarray(tokens[i:i + batch])
    logp = jax.nn.log_softmax(fwd(t)[:, :-1].astype(jnp.float32), axis=-1)
    out.append(np.asarray(-jnp.take_along_axis(logp, t[:, 1:, None], axis=-1)[..., 0]))
  return np.concatenate(out)


def position_losses(losses: np.ndarray, seq_len: int, mults=(1, 2, 4, 8)) -> dict[str, float]:
  """From [n, T - 1] per-token losses (loss j predicts token j + 1): the mean loss per position
  bucket [0, L), [L, 2L), ... and over the first mL positions ("loss@mL")."""
  out = {}
  lo, prev = 0, 0
  for m in mults:
    hi = min(m * seq_len - 1, losses.shape[1])
    out[f"positions {prev}L-{m}L"] = float(losses[:, lo:hi].mean())
    out[f"loss@{m}L"] = float(losses[:, :hi].mean())
    lo, prev = hi, m
  return out


def passkey_prompts(tokenizer, filler: np.ndarray, length: int, depth: float, keys
                    ) -> tuple[np.ndarray, np.ndarray]:
  """Rows of `length` tokens: held-out text with "The pass key is K. Remember it. K is the
  pass key." at `depth` (fraction of the text before it), then "What is the pass key? The pass
  key is K."; returns (rows [n, length], answer_lens [n]): each row ends with its answer
  " K." (answer_lens tokens)."""
  rows, lens = [], []
  for i, key in enumerate(keys):
    needle = tokenizer.encode(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
    question = tokenizer.encode("\nWhat is the pass key? The pass key is")
    answer = tokenizer.encode(f" {key}.")
    n_fill = length - len(needle) - len(question) - len(answer)
    text = filler[i % len(filler)][:n_fill]
    cut = int(round(depth * n_fill))
    rows.append(list(text[:cut]) + needle + list(text[cut:]) + question + answer)
    lens.append(len(answer))
  return np.asarray(rows, np.int32), np.asarray(lens)


def passkey_accuracy(logits_fn, rows: np.ndarray, answer_lens: np.ndarray, batch: int = 4
                     ) -> float:
  """Fraction of rows whose greedy continuation reproduces the answer (the argmax at every
  answer position, teacher-forced, equals the true token: the same as greedy decoding)."""
  fwd = lambda t: jnp.argmax(logits_fn(t)[:, :-1], axis=-1)
  pred = np.concatenate([np.asarray(fwd(jnp.asarray(rows[i:i + batch])))
                         for i in range(0, len(rows), batch)])  # pred[:, j] -> token j + 1
  hits = [bool((pred[r, -a:] == rows[r, -a:]).all()) for r, a in enumerate(answer_lens)]
  return float(np.mean(hits))


def probe_run(run_dir: pathlib.Path, kinds: tuple[str, ...], *, rows: int = 4,
              passkeys: int = 4, depths=(0.0, 0.5, 1.0), mults=(1, 2, 4, 8)
              ) -> dict[str, Any]:
  """The probes `kinds` ("gate", "activation", "load", "length") of a finished run."""
  steps = checkpoint_steps(run_dir)
  model, tokenizer, stage = load_at(run_dir, steps[-1])
  L = stage.seq_len
  out: dict[str, Any] = {"step": steps[-1]}
  if "gate" in kinds or "activation" in kinds:
    toks = heldout_rows(stage, tokenizer, L, rows)
    if "gate" in kinds:  # over training: every kept checkpoint
      out["gate_exponent"] = {}
      for s in steps:
        m = model if s == steps[-1] else load_at(run_dir, s)[0]
        out["gate_exponent"][s] = gate_exponents(m, toks)
    if "activation" in kinds:
      out["ffn_activation_max"] = ffn_activation_max(model, toks)
  if "load" in kinds:
    toks = load_rows(stage, tokenizer, L)
    out["heldout_load_tokens"] = int(toks.size)
    out["heldout_max_mean_load"] = moe_load(model, toks)
  if "length" in kinds:
    long = heldout_rows(stage, tokenizer, max(mults) * L, rows)
    logits_fn = jax.jit(lambda t: model(t))  # one trace per shape
    out["position_losses"] = position_losses(token_losses(logits_fn, long), L, mults)
    filler = heldout_rows(stage, tokenizer, max(mults) * L, passkeys)
    keys = np.random.default_rng(0).integers(10_000, 100_000, passkeys)
    out["passkey"] = {}
    for m in mults:
      for d in depths:
        prompts, n = passkey_prompts(tokenizer, filler, m * L, d, keys)
        out["passkey"][f"{m}L@{d:g}"] = passkey_accuracy(logits_fn, prompts, n)
  return out
