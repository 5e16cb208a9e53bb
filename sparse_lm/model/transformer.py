"""The decoder: embeddings, KDA / Gated-MLA layers with MoE FFNs, AttnRes, LM head.

Layer layout (ARCHITECTURE.md §1; cfg.layer_types): layer i is Gated MLA when
(i + 1) % mla_every == 0 or i is the last layer, else KDA. With mla_every = 4 the layers form
groups of 4 (KDA, KDA, KDA, MLA) plus one final MLA layer. Layer 0 (and any layer
< num_dense_layers) uses the dense SiTU-GLU FFN; every other layer a Stable LatentMoE.

How the stack runs:
  - `head`:   the first group (layers 0 .. mla_every-1), unrolled, because layer 0 has the dense
              FFN and so different parameters from the repeated groups; rematerialised as one
              unit per cfg.remat_policy, like each scanned group.
  - `groups`: groups 1 .. G-1 (layers mla_every .. num_layers-2), created with `nnx.vmap` so
              every parameter has a leading `layers` axis [G-1, ...]. With cfg.scan_layers the
              groups run as one `jax.lax.scan` (compile time independent of depth), otherwise a
              Python loop over the same stacked parameters (same checkpoint layout, same
              numbers). Each group is wrapped in `jax.checkpoint` per cfg.remat_policy.
  - `tail`:   when (num_layers - 1) % mla_every != 0 (Kimi-Linear-48B: 27 layers, MLA every
              4th and last), the KDA layers between the last full group and `last`, unrolled;
              None otherwise.
  - `last`:   the final MLA layer, outside the scan (rematerialised the same way).

Each decoder layer has two sub-layers (token mixer, FFN), each reading its input from the
residual stream of `attnres.py` (pre-norm applied to that input) and adding its output back.
Blocks of AttnRes open at layers 0, B, 2B, ... (B = cfg.attnres_block_layers, a multiple of
mla_every, so a block always opens at the first layer of a group).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from sparse_lm import sharding
from sparse_lm.config import ModelConfig
from sparse_lm import nn
from sparse_lm.model import attnres
from sparse_lm.model.kda import KDA
from sparse_lm.model.mla import MLA
from sparse_lm.moe import LatentMoE, SiTUGLU
from sparse_lm.vision.encoder import VisionEncoder


class DecoderLayer(nnx.Module):
  """One decoder layer: token mixer (KDA or MLA) and FFN (dense SiTU-GLU or LatentMoE).

  Params: mixer, ffn, attn_norm / ffn_norm (pre-norms, [D] fp32), attn_query / ffn_query
  (AttnRes pseudo-queries [D] fp32, zero init, no weight decay).
  """

  def __init__(self, cfg: ModelConfig, *, mixer: str, dense_ffn: bool, rngs: nnx.Rngs):
    self.cfg = cfg
    self.mixer_kind = mixer
    self.dense_ffn = dense_ffn
    self.attn_norm = nn.RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
    self.mixer = KDA(cfg, rngs=rngs) if mixer == "kda" else MLA(cfg, rngs=rngs)
    self.ffn_norm = nn.RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
    if dense_ffn:
      self.ffn = SiTUGLU(cfg.d_model, cfg.dense_hidden, cfg=cfg, rngs=rngs)
    else:
      self.ffn = LatentMoE(cfg, rngs=rngs)
    q = lambda: nn.param(rngs, (cfg.d_model,), ("norm",), init=nn.zeros_init)
    self.attn_query = q()
    self.ffn_query = q()

  def __call__(self, stream: dict, *, opens_block, segment_ids, valid, train: bool
               ) -> tuple[dict, dict | None]:
    """stream -> (stream, MoE aux or None). `opens_block` may be a traced bool."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    # Named scopes label the ops in profiles (benchmarks/train_step.py --profile); they
    # change no value.
    with jax.named_scope("attnres"):
      stream = attnres.open_block(cfg, stream, opens_block)
      h = attnres.sublayer_input(cfg, stream, self.attn_query[...])
    with jax.named_scope("norm"):
      x = self.attn_norm(h).astype(dtype)
    mix_kw = {"train": train} if self.mixer_kind == "mla" else {}
    with jax.named_scope(self.mixer_kind):
      y = self.mixer(x, segment_ids=segment_ids, **mix_kw)
    with jax.named_scope("attnres"):
      stream = attnres.add_output(cfg, stream, y)
      h = attnres.sublayer_input(cfg, stream, self.ffn_query[...])
    with jax.named_scope("norm"):
      x = self.ffn_norm(h).astype(dtype)
    if self.dense_ffn:
      with jax.named_scope("dense_ffn"):
        y, aux = self.ffn(x), None
    else:
      with jax.named_scope("moe"):
        y, aux = self.ffn(x, valid=valid, train=train)
    with jax.named_scope("attnres"):
      return attnres.add_output(cfg, stream, y), aux


class LayerGroup(nnx.Module):
  """mla_every consecutive layers: (mla_every - 1) KDA layers then one MLA layer."""

  def __init__(self, cfg: ModelConfig, *, first_layer: int, rngs: nnx.Rngs):
    types = cfg.layer_types[first_layer:first_layer + cfg.mla_every]
    self.layers = nnx.List([
        DecoderLayer(cfg, mixer=t, dense_ffn=first_layer + j < cfg.num_dense_layers, rngs=rngs)
        for j, t in enumerate(types)])

  def __call__(self, stream, *, opens_block, segment_ids, valid, train):
    auxes = []
    for j, layer in enumerate(self.layers):
      stream, aux = layer(stream, opens_block=opens_block if j == 0 else False,
                          segment_ids=segment_ids, valid=valid, train=train)
      if aux is not None:
        auxes.append(aux)
    return stream, auxes


def _stacked_groups(cfg: ModelConfig, n: int, rngs: nnx.Rngs) -> LayerGroup:
  """n LayerGroups with every variable stacked on a leading `layers` axis.

  Built eagerly one group at a time (cheap NumPy initialisers), stacked, and each variable's
  logical axis names get "layers" prepended (what `nnx.vmap(transform_metadata=...)` would
  do). Under tracing (eval_shape, jit) the groups are made by `nnx.vmap` instead (same
  structure and metadata; the random values differ from an eager build with the same seed).
  """
  if isinstance(rngs.params.key[...], jax.core.Tracer):
    # Tracing (eval_shape / jit): create one group under nnx.vmap. Building n groups in one
    # trace is quadratic: every Variable made from a tracer asks for its `.sharding`, whose
    # error message walks the whole trace (610 s for the full preset).
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r):
      return LayerGroup(cfg, first_layer=cfg.mla_every, rngs=r)
    return make(rngs)
  return nn.stack_modules(
      [LayerGroup(cfg, first_layer=cfg.mla_every, rngs=rngs) for _ in range(n)])


def _pure_call(graphdef, params, rest, stream, **kw):
  """Call the module (graphdef, params, rest) on `stream` as a pure function: returns (its
  output, its non-Param state after the call, e.g. updated balancer histograms). What
  `jax.checkpoint` and `lax.scan` wrap."""
  m = nnx.merge(graphdef, params, rest)
  out = m(stream, **kw)
  _, _, rest_new = nnx.split(m, nnx.Param, ...)
  return out, rest_new


def _remat_call(cfg: ModelConfig, module: nnx.Module, stream: dict, *, opens_block: bool,
                segment_ids, valid, train: bool, remat: bool = True):
  """`module(stream, ...)` under `jax.checkpoint` with cfg.remat_policy (plain call for "none",
  or with remat=False: a unit that cfg.remat_skip_last keeps).

  Used for the layers outside the scanned groups (the head group and the last layer) so that
  they, too, keep only their input stream for the backward pass. Non-Param variables the call
  updates (the balancer histograms) are written back to `module`.
  """
  policy = nn.remat_policy(cfg.remat_policy) if remat else None
  if policy is None:
    return module(stream, opens_block=opens_block, segment_ids=segment_ids, valid=valid,
                  train=train)
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def call(stream, params, rest, segment_ids, valid):
    return _pure_call(graphdef, params, rest, stream, opens_block=opens_block,
                      segment_ids=segment_ids, valid=valid, train=train)

  out, rest_new = jax.checkpoint(call, policy=policy)(stream, params, rest, segment_ids, valid)
  nnx.update(module, rest_new)
  return out


def _stack_aux(auxes: list[dict]) -> dict:
  """Per-layer MoE aux dicts (the same keys in every layer) -> arrays stacked over layers."""
  return {k: jnp.stack([a[k] for a in auxes]) for k in auxes[0]}


class Transformer(nnx.Module):
  """The text decoder of ARCHITECTURE.md §1-§6 (see the module docstring for the layout).

  Call: `model(tokens [B,T] int32, *, segment_ids=None, images=None, train=False)` -> fp32
  logits [B, T, vocab]. `forward_hidden` returns the final normalised hidden states and the
  per-MoE-layer aux metrics (what the chunked loss uses).

  Params: embed [vocab, embed]; head, groups (stacked `layers` axis), last; final_query [D]
  (AttnRes), final_norm [D]; lm_head [embed, vocab] (untied).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if cfg.num_dense_layers > cfg.mla_every:
      raise NotImplementedError(
          f"num_dense_layers={cfg.num_dense_layers} > mla_every={cfg.mla_every}: dense FFN "
          "layers must all sit in the first (unrolled) layer group")
    self.cfg = cfg
    self.embed = nn.Embed(cfg, rngs=rngs)
    self.head = LayerGroup(cfg, first_layer=0, rngs=rngs)
    self.num_groups = (cfg.num_layers - 1) // cfg.mla_every  # including the head group
    n = self.num_groups - 1
    self.groups = _stacked_groups(cfg, n, rngs) if n > 0 else None
    tail = cfg.num_layers - 1 - self.num_groups * cfg.mla_every
    self.tail = nnx.List([DecoderLayer(cfg, mixer="kda", dense_ffn=False, rngs=rngs)
                          for _ in range(tail)]) if tail else None
    self.last = DecoderLayer(cfg, mixer="mla", dense_ffn=False, rngs=rngs)
    self.final_query = nn.param(rngs, (cfg.d_model,), ("norm",), init=nn.zeros_init)
    self.final_norm = nn.RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)
    self.lm_head = nn.dense_param(rngs, (cfg.d_model,), (cfg.vocab_size,),
                                      ("embed", "vocab"), cfg)
    # Created last so a text-only model's parameters do not depend on cfg.vision.
    self.vision = VisionEncoder(cfg, rngs=rngs) if cfg.vision else None

  # ------------------------------------------------------------------ stack
  def remat_units(self) -> list[str]:
    """The stack's rematerialisation units in forward order: "head", "group1" .. the scanned
    groups, "tail0" .. the tail layers, "last". cfg.remat_skip_last counts from the end."""
    n = self.num_groups - 1 if self.groups is not None else 0
    tail = len(self.tail) if self.tail is not None else 0
    return (["head"] + [f"group{g + 1}" for g in range(n)] + [f"tail{j}" for j in range(tail)]
            + ["last"])

  def _kept_units(self) -> set[str]:
    """The units cfg.remat_skip_last runs without jax.checkpoint (the last ones)."""
    k, units = self.cfg.remat_skip_last, self.remat_units()
    return set(units[len(units) - k:]) if k else set()

  def _run_groups(self, stream, *, segment_ids, valid, train):
    """Groups 1..G-1 over the stacked params: lax.scan or a Python loop (cfg.scan_layers).

    The last groups that cfg.remat_skip_last keeps run after the scan, one static slice of
    the stacked params each, without jax.checkpoint."""
    cfg = self.cfg
    graphdef, params, rest = nnx.split(self.groups, nnx.Param, ...)
    n = self.num_groups - 1
    keep = len({f"group{g + 1}" for g in range(n)} & self._kept_units())
    opens = [cfg.mla_every * (1 + g) % cfg.attnres_block_layers == 0 for g in range(n)]
    # Static when every group agrees (a block per group, as in the presets): then the layers
    # that cannot open a block trace no stack write (`attnres.open_block`).
    static_opens = opens[0] if len(set(opens)) == 1 else None
    opens = jnp.asarray(opens)

    def plain(stream, xs):
      p, r, o = xs
      o = o if static_opens is None else static_opens
      (stream, auxes), r_new = _pure_call(graphdef, p, r, stream, opens_block=o,
                                          segment_ids=segment_ids, valid=valid, train=train)
      return stream, (_stack_aux(auxes), r_new)

    body = plain
    policy = nn.remat_policy(cfg.remat_policy)
    if policy is not None:
      body = jax.checkpoint(plain, policy=policy, prevent_cse=not cfg.scan_layers)
    xs_all = (params, rest, opens)
    outs = []
    if cfg.scan_layers and n - keep > 0:
      xs = xs_all if keep == 0 else jax.tree.map(lambda a: a[:n - keep], xs_all)
      stream, out = jax.lax.scan(body, stream, xs)
      outs.append(out)
    else:
      for g in range(n - keep):
        stream, out = body(stream, jax.tree.map(lambda a: a[g], xs_all))
        outs.append(jax.tree.map(lambda a: a[None], out))
    for g in range(n - keep, n):
      stream, out = plain(stream, jax.tree.map(lambda a: a[g], xs_all))
      outs.append(jax.tree.map(lambda a: a[None], out))
    aux, rest_new = jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
    if train:  # an eval forward changes no variable: it writes none back (then a plain
      nnx.update(self.groups, rest_new)  # jax.jit may close over the model)
    aux = {k: v.reshape((-1,) + v.shape[2:]) for k, v in aux.items()}  # [n * moe/group, ...]
    return stream, aux

  def forward_hidden(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                     images=None, train: bool = False) -> tuple[jax.Array, dict]:
    """Final hidden states and MoE metrics.

    Args:
      tokens: [B, T] int32.
      segment_ids: [B, T] int32 packed-document ids (0 = padding) or None (one document).
      images: None, a `sparse_lm.vision.ImageBatch` (pixels [N, H, W, 3], sizes [N, 2]:
        `vision.pad_images`) whose encoded tokens replace the `<image>` placeholder spans of
        `tokens` in reading order (ARCHITECTURE §7), or a `PackedImages` (`vision.pack_images`,
        what the data pipeline feeds: row b's images fill row b's spans); pixels are uint8
        0..255 or already normalised floats (`data.images.normalize`). Needs cfg.vision.
      train: accumulate the balancer statistics of the MoE layers.

    Returns:
      h: [B, T, D] in cfg.dtype, after the final AttnRes and RMSNorm (the LM head's input).
      aux: dict of fp32 arrays stacked over the MoE layers in layer order
        (num_layers - num_dense_layers): the keys of `LatentMoE.__call__`'s aux
        ("max_violation", "dead_frac", "assigned", "dropped", "drop_rate", "aux_loss" [L],
        "load" [L, E]; under expert parallelism "recv_rows_max", "recv_rows_mean",
        "recv_buffer_rows" [L]).

    Raises:
      ValueError: images given to a model built without cfg.vision.
      TypeError: images is neither an ImageBatch nor a PackedImages.
    """
    cfg = self.cfg
    valid = None if segment_ids is None else segment_ids != 0
    if images is not None and self.vision is None:
      raise ValueError("images were given but the model has no vision encoder: build it "
                       "with get_preset(..., vision=True) (ModelConfig.vision)")
    with jax.named_scope("embed"):
      x = self.embed(tokens)
    if images is not None:
      with jax.named_scope("vision"):
        x = self.vision.embed_into(x, tokens, images)
    stream = attnres.init_stream(cfg, x)
    kw = dict(segment_ids=segment_ids, valid=valid, train=train)
    kept = self._kept_units()
    stream, auxes = _remat_call(cfg, self.head, stream, opens_block=True,
                                remat="head" not in kept, **kw)
    aux = [_stack_aux(auxes)] if auxes else []
    if self.groups is not None:
      stream, group_aux = self._run_groups(stream, **kw)
      aux.append(group_aux)
    for j, layer in enumerate(self.tail or ()):
      i = self.num_groups * cfg.mla_every + j
      stream, tail_aux = _remat_call(
          cfg, layer, stream, opens_block=i % cfg.attnres_block_layers == 0,
          remat=f"tail{j}" not in kept, **kw)
      aux.append(_stack_aux([tail_aux]))
    last_first = cfg.num_layers - 1
    stream, last_aux = _remat_call(
        cfg, self.last, stream, opens_block=last_first % cfg.attnres_block_layers == 0,
        remat="last" not in kept, **kw)
    aux.append(_stack_aux([last_aux]))
    aux = {k: jnp.concatenate([a[k] for a in aux]) for k in aux[0]}
    with jax.named_scope("attnres"):
      h = attnres.final_output(cfg, stream, self.final_query[...])
    with jax.named_scope("norm"):
      h = self.final_norm(h).astype(jnp.dtype(cfg.dtype))
    h = sharding.constrain(h, ("activation_batch", "activation_length", "activation_embed"))
    return h, aux

  def logits(self, h: jax.Array) -> jax.Array:
    """LM head: h [..., D] -> fp32 logits [..., vocab] (matmul in cfg.dtype, fp32 accum)."""
    return nn.project(h, self.lm_head[...], dtype=jnp.dtype(self.cfg.dtype),
                          out_dtype=jnp.float32)

  def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
               images=None, train: bool = False) -> jax.Array:
    """tokens [B, T] int32 -> fp32 logits [B, T, vocab] (materialised: use the chunked loss
    in `loss.py` for training)."""
    h, _ = self.forward_hidden(tokens, segment_ids=segment_ids, images=images, train=train)
    logits = self.logits(h)
    return sharding.constrain(logits, ("activation_batch", "activation_length",
                                       "activation_vocab"))
