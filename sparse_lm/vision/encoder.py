"""Native-resolution ViT encoder + 2x2 patch merge + MLP projector (ARCHITECTURE.md §7).

Sources: Kimi-VL / MoonViT (arXiv 2504.07491 §2.1: native resolution, 2D RoPE over height and
width, pixel-shuffle 2x2 merge then a two-layer MLP projector); NaViT (arXiv 2307.06304:
native aspect ratio, variable token counts per image); RoFormer (arXiv 2104.09864) for RoPE.

    patches  x_0 = patchify(pixels) W_patch                     [N, P, C]   P = patch grid
    L times  x += Attn(RMSNorm(x)),  q, k rotated by 2D RoPE at (row, col), padding keys masked
             x += W_2 gelu(W_1 RMSNorm(x))
    merge    z = merge_2x2(RMSNorm(x))                            [N, P/4, 4C]
    project  e = RMSNorm(W_p2 gelu(W_p1 z))                       [N, P/4, D]
    compact  valid tokens of each image moved to the front       [N, M, D] + mask [N, M]

Choices not fixed by the sources (documented, not config fields):
  * Position information is 2D RoPE only (MoonViT also keeps SigLIP's interpolated learned
    absolute embedding; RoPE alone keeps the encoder free of any reference resolution). Half of
    each head's channels rotate with the patch row, half with the column, base ROPE_THETA.
  * RMSNorm everywhere (the decoder's norm) instead of SigLIP's LayerNorm; no biases.
  * Projector hidden width 4C (the merged width); a final RMSNorm with learned scale so image
    tokens enter the residual stream at RMS ~1, like the unit-variance text embeddings
    (`nn.Embed`).
  * Attention is exact softmax over all patches of an image: with packed rows on a Hopper GPU
    with tokamax (cfg.attention_backend "auto" or "tokamax"), tokamax's kernels over each image's
    key range; otherwise queries and keys blocked by cfg.attention_chunk_size (the decoder's
    blocked softmax, `flash_attention`) to bound memory.
  * Images do not attend to each other. Two input forms: a padded batch [N, H, W, 3] with a
    key mask (`__call__`, `ImageBatch`), or NaViT-style packed rows of patches with segment
    ids (`encode_packed`, `PackedImages`: what the data pipeline feeds; fixed shapes for any
    mix of image sizes).

Logical axis names of the parameters: vision_patch (p*p*3 pixel values), vision_embed (C),
heads, kv (head dim), vision_mlp (ViT MLP hidden and projector hidden), vision_merged (4C),
embed (D, the projector output), norm; stacked ViT layers carry a leading `layers` axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.attention import flash_attention, resolve_backend, run_ranges, tokamax_masked
from sparse_lm import nn, sharding
from sparse_lm.config import ModelConfig
from sparse_lm.data import images as image_data
from sparse_lm.vision import merge, patches
from sparse_lm.vision.patches import ImageBatch, PackedImages

ROPE_THETA = 10_000.0


# ------------------------------------------------------------------------------ pure math


def rope_2d_tables(rows: np.ndarray, cols: np.ndarray, head_dim: int,
                   theta: float = ROPE_THETA) -> tuple[jax.Array, jax.Array]:
  """cos / sin tables of 2D RoPE for patches at (rows, cols).

  Args:
    rows, cols: int [P] patch coordinates.
    head_dim: Dh, a multiple of 4 (Dh/2 channels per axis, rotated in Dh/4 pairs).
    theta: RoPE base.

  Returns:
    (cos, sin) fp32 [P, Dh/2]: the first Dh/4 columns are row angles, the last Dh/4 column
    angles, matching the channel split in `apply_rope_2d`.

  Raises:
    ValueError: head_dim not a multiple of 4.
  """
  if head_dim % 4:
    raise ValueError(f"2D RoPE needs head_dim % 4 == 0, got {head_dim}")
  quarter = head_dim // 4
  inv_freq = theta ** (-np.arange(quarter, dtype=np.float64) / quarter)
  ang = np.concatenate([np.asarray(rows, np.float64)[:, None] * inv_freq,
                        np.asarray(cols, np.float64)[:, None] * inv_freq], axis=-1)
  return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def rope_2d_angles(coords: jax.Array, head_dim: int, theta: float = ROPE_THETA
                   ) -> tuple[jax.Array, jax.Array]:
  """`rope_2d_tables` for traced coordinates: coords int [..., 2] (row, col) -> (cos, sin)
  fp32 [..., Dh/2] (same layout: row angles, then column angles)."""
  quarter = head_dim // 4
  inv_freq = jnp.asarray(theta ** (-np.arange(quarter, dtype=np.float64) / quarter), jnp.float32)
  c = coords.astype(jnp.float32)
  ang = jnp.concatenate([c[..., :1] * inv_freq, c[..., 1:] * inv_freq], axis=-1)
  return jnp.cos(ang), jnp.sin(ang)


def apply_rope_2d(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate x [N, P, H, Dh] by 2D RoPE; cos / sin [P, Dh/2] (`rope_2d_tables`, shared by the
  N images) or [N, P, Dh/2] (`rope_2d_angles`, per packed patch).

  Channels [0, Dh/2) encode the row and [Dh/2, Dh) the column; within each half, channel j
  pairs with j + Dh/4 (rotate-half convention). Computed in fp32, returned in x.dtype. The dot
  product of a rotated query at (r, c) and key at (r', c') depends only on (r - r', c - c').
  """
  dh = x.shape[-1]
  xf = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, 2, dh // 4)  # [.., axis, pair, Dh/4]
  c = cos.reshape(cos.shape[:-1] + (1, 2, 1, dh // 4))
  s = sin.reshape(sin.shape[:-1] + (1, 2, 1, dh // 4))
  x1, x2 = xf[..., 0:1, :], xf[..., 1:2, :]
  rotated = jnp.concatenate([-x2, x1], axis=-2)
  return (xf * c + rotated * s).reshape(x.shape).astype(x.dtype)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None = None,
                     *, segment_ids: jax.Array | None = None,
                     query_chunk: int | None = None, backend: str = "xla_chunked") -> jax.Array:
  """Bidirectional softmax attention within images.

  Args:
    q, k, v: [N, P, H, Dh] in the compute dtype.
    key_mask: bool [N, P], False for padding patches (one image per row; every query sees the
      valid keys), or
    segment_ids: int [N, P] instead: the image of each patch of a packed row (0 = padding);
      query i sees key j iff segment_ids[i] == segment_ids[j] != 0 (NaViT packing), so a
      patch's output does not depend on the other images of its row.
    query_chunk: query and key block of the blocked softmax (None: one block of P); the fp32
      logits held at once are [N, H, query_chunk, query_chunk] instead of [N, H, P, P], in the
      forward and the (recomputing) backward pass; the result is the same up to fp32 rounding.
    backend: the decoder's `attention_backend` ("auto" resolved as there). With packed
      `segment_ids` and "tokamax" (what "auto" is on a Hopper GPU with tokamax), tokamax's
      kernels with each patch's run of equal ids as its key range (`image_key_ranges`; equal ids
      must be one contiguous run per row, as `PackedImages` lays them out): the forward kernel
      skips the key blocks outside a query block's images (the backward, in tokamax 0.0.17,
      does not), where the blocked softmax runs every one of the (P / block)^2 block pairs as
      its own small kernels (the small preset's 8 x 8,192 patch slots took 65% of its train
      step on an H200 that way, docs/benchmarks.md). Otherwise
      `pallas_kernels.attention.flash_attention`, causal=False.

  Returns:
    [N, P, H, Dh] in q.dtype. Logits and softmax in fp32, scale 1/sqrt(Dh). A query with no
    visible key (an empty slot) gets a zero row and zero gradients.
  """
  N, P = q.shape[:2]
  scale = q.shape[-1] ** -0.5
  if segment_ids is not None and resolve_backend(backend) == "tokamax":
    start, end = image_key_ranges(segment_ids)
    o = tokamax_masked(q, k, v, scale=scale, k_start=start, k_end=end)
    return jnp.where((segment_ids > 0)[..., None, None], o, 0).astype(q.dtype)
  block = P if query_chunk is None else query_chunk
  if segment_ids is None:
    kseg = key_mask.astype(jnp.int32)  # 0 = padding key
    qseg = jnp.ones((N, P), jnp.int32)
  else:
    kseg = qseg = segment_ids.astype(jnp.int32)
  pos = jnp.arange(P, dtype=jnp.int32)
  return flash_attention(q, k, v, pos, pos, qseg, kseg, scale=scale,
                         block_q=block, block_k=block, causal=False)


def image_key_ranges(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The keys each patch of a packed row may see, as ranges: start, end int32 [N, P].

  Patch i of a run of equal non-zero ids [a, b) gets [a, b): its image (equal ids must form
  one contiguous run per row, as `PackedImages` lays them out). A padding patch (id 0) gets
  [i, i + 1), itself only, so no query has an empty range and padding costs one diagonal
  block; `masked_attention` zeroes its output.
  """
  start, end = run_ranges(segment_ids)
  t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None]
  pad = segment_ids == 0
  return jnp.where(pad, t, start), jnp.where(pad, t + 1, end)


def prefix_branch(segment_ids: jax.Array, sizes: list[int]) -> jax.Array:
  """Index into `sizes` (ascending prefix lengths, the last = L) of the shortest prefix that
  holds every non-empty slot (segment id != 0) of every row: int32 scalar, 0 when no slot is
  used. segment_ids int [R, L]."""
  L = segment_ids.shape[1]
  slot = jnp.arange(L, dtype=jnp.int32)
  extent = jnp.max(jnp.where(segment_ids > 0, slot + 1, 0))  # one past the last used slot
  return jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < extent).astype(jnp.int32)


def check_images(images, kinds) -> None:
  """Raises TypeError unless `images` is an instance of `kinds` (ImageBatch and / or
  PackedImages; NamedTuples, so they survive jit as themselves), naming what was given and
  how to build the right one."""
  if isinstance(images, kinds):
    return
  names = " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
  got = type(images).__name__
  if hasattr(images, "shape"):
    got += f" of shape {tuple(images.shape)}"
  elif isinstance(images, (tuple, list)):
    got += f" of {len(images)} items"
  raise TypeError(f"images must be a vision.{names} (build one with vision.pad_images / "
                  f"vision.pack_images), got a {got}")


# ------------------------------------------------------------------------------ modules


def _check(cfg: ModelConfig) -> None:
  c, h = cfg.vision_width, cfg.vision_heads
  if min(c, h, cfg.vision_layers, cfg.vision_mlp, cfg.vision_patch_size) <= 0:
    raise ValueError(f"ModelConfig({cfg.name}): vision_* sizes must be > 0")
  if c % h or (c // h) % 4:
    raise ValueError(f"ModelConfig({cfg.name}): vision_width={c} / vision_heads={h} must be "
                     "an integer head dim divisible by 4 (2D RoPE splits it in 4)")


class VisionBlock(nnx.Module):
  """One pre-norm ViT layer: x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)).

  Params (cfg.param_dtype; norms fp32): attn_norm [C]; w_q, w_k, w_v [C, H, Dh]
  (vision_embed, heads, kv); w_o [H, Dh, C] (heads, kv, vision_embed); mlp_norm [C];
  w_1 [C, F] (vision_embed, vision_mlp); w_2 [F, C] (vision_mlp, vision_embed).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    C, H, F = cfg.vision_width, cfg.vision_heads, cfg.vision_mlp
    dh = C // H
    dense = lambda i, o, n: nn.dense_param(rngs, i, o, n, cfg)
    self.dtype = jnp.dtype(cfg.dtype)
    self.query_chunk = cfg.attention_chunk_size
    self.attention_backend = cfg.attention_backend
    self.attn_norm = nn.RMSNorm(C, cfg=cfg, rngs=rngs)
    self.w_q = dense((C,), (H, dh), ("vision_embed", "heads", "kv"))
    self.w_k = dense((C,), (H, dh), ("vision_embed", "heads", "kv"))
    self.w_v = dense((C,), (H, dh), ("vision_embed", "heads", "kv"))
    self.w_o = dense((H, dh), (C,), ("heads", "kv", "vision_embed"))
    self.mlp_norm = nn.RMSNorm(C, cfg=cfg, rngs=rngs)
    self.w_1 = dense((C,), (F,), ("vision_embed", "vision_mlp"))
    self.w_2 = dense((F,), (C,), ("vision_mlp", "vision_embed"))

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, valid: jax.Array,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """x fp32 [N, P, C]; cos/sin [P or N x P, Dh/2]; valid bool [N, P] (padded images) or
    segment_ids int [N, P] (packed rows, see `masked_attention`) -> fp32 [N, P, C]."""
    dt = self.dtype
    h = self.attn_norm(x).astype(dt)
    q = apply_rope_2d(nn.project(h, self.w_q[...]), cos, sin)
    k = apply_rope_2d(nn.project(h, self.w_k[...]), cos, sin)
    v = nn.project(h, self.w_v[...])
    o = masked_attention(q, k, v, valid, segment_ids=segment_ids, query_chunk=self.query_chunk,
                         backend=self.attention_backend)
    x = x + nn.project(o, self.w_o[...], 2, out_dtype=jnp.float32)
    h = self.mlp_norm(x).astype(dt)
    h = jax.nn.gelu(nn.project(h, self.w_1[...]), approximate=True)
    h = sharding.constrain(h, ("activation_batch", None, "activation_mlp"))
    return x + nn.project(h, self.w_2[...], out_dtype=jnp.float32)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> VisionBlock:
  """cfg.vision_layers VisionBlocks with every param stacked on a leading `layers` axis."""
  return nn.stack_modules([VisionBlock(cfg, rngs=rngs) for _ in range(cfg.vision_layers)])


class VisionEncoder(nnx.Module):
  """Native-resolution ViT + 2x2 merge + MLP projector into d_model (module docstring).

  Call: `encoder(pixels [N, H, W, 3], sizes [N, 2] int)` -> (embeddings fp32 [N, M, D],
  mask bool [N, M]), M = ceil(H/2p) * ceil(W/2p) for the padded canvas (H, W need not be
  multiples of 2p: the canvas is zero-padded). pixels uint8 0..255 are normalised with
  `data.images.normalize` (as `encode_packed` does uint8 patches, so both paths give the same
  tokens for the same image); float pixels are taken as already normalised. Image n's valid
  tokens are embeddings[n, :m_n] with m_n = num_image_tokens(h_n, w_n, p), row-major over its
  own merged grid; the rest are zeros. Works under jit with traced sizes (shapes depend only on
  the canvas).

  Params: patch_embed [p*p*3, C] (vision_patch, vision_embed); blocks (stacked `layers` axis,
  see VisionBlock); final_norm [C]; proj_1 [4C, 4C] (vision_merged, vision_mlp); proj_2
  [4C, D] (vision_mlp, embed); out_norm [D].

  Raises (construction): ValueError for inconsistent vision_* fields.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    _check(cfg)
    self.cfg = cfg
    C, p = cfg.vision_width, cfg.vision_patch_size
    merged = patches.MERGE * patches.MERGE * C
    self.patch_embed = nn.dense_param(rngs, (p * p * 3,), (C,),
                                          ("vision_patch", "vision_embed"), cfg)
    self.blocks = _stacked_blocks(cfg, rngs)
    self.final_norm = nn.RMSNorm(C, cfg=cfg, rngs=rngs)
    self.proj_1 = nn.dense_param(rngs, (merged,), (merged,),
                                     ("vision_merged", "vision_mlp"), cfg)
    self.proj_2 = nn.dense_param(rngs, (merged,), (cfg.d_model,), ("vision_mlp", "embed"),
                                     cfg)
    self.out_norm = nn.RMSNorm(cfg.d_model, cfg=cfg, rngs=rngs)

  def _run_blocks(self, x, cos, sin, valid, segment_ids=None):
    cfg = self.cfg
    graphdef, params, rest = nnx.split(self.blocks, nnx.Param, ...)

    def body(x, p):
      return nnx.merge(graphdef, p, rest)(x, cos, sin, valid, segment_ids), None

    policy = nn.remat_policy(cfg.remat_policy)
    if policy is not None:
      body = jax.checkpoint(body, policy=policy, prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      x, _ = jax.lax.scan(body, x, params)
    else:
      for i in range(cfg.vision_layers):
        x, _ = body(x, jax.tree.map(lambda a: a[i], params))
    return x

  def __call__(self, pixels: jax.Array, sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """See the class docstring. pixels [N, H, W, 3] uint8 or normalised float; sizes [N, 2]
    int (height, width).

    Raises:
      ValueError: pixels not [N, H, W, 3] or sizes not [N, 2].
    """
    cfg = self.cfg
    p, dt = cfg.vision_patch_size, jnp.dtype(cfg.dtype)
    if pixels.ndim != 4 or pixels.shape[-1] != 3 or sizes.shape != (pixels.shape[0], 2):
      raise ValueError(f"VisionEncoder: pixels must be [N, H, W, 3] and sizes [N, 2], got "
                       f"{pixels.shape} and {sizes.shape}")
    if pixels.dtype == jnp.uint8:  # before padding / masking: those zeros mean 0.0
      pixels = image_data.normalize(pixels)
    pixels = patches.pad_to_cells(pixels, p)
    pixels = patches.mask_pixels(pixels, sizes)
    N, H, W, _ = pixels.shape
    gh, gw = H // p, W // p
    x = patches.patchify(pixels.astype(dt), p).reshape(N, gh * gw, p * p * 3)
    x = nn.project(x, self.patch_embed[...], out_dtype=jnp.float32)
    x = sharding.constrain(x, ("activation_batch", None, "activation_embed"))
    valid = patches.patch_validity(sizes, gh, gw, p)
    rows, cols = patches.patch_positions(gh, gw)
    cos, sin = rope_2d_tables(rows, cols, cfg.vision_width // cfg.vision_heads)
    x = self._run_blocks(x, cos, sin, valid)
    z = patches.merge_2x2(self.final_norm(x).astype(dt), gh, gw)
    z = jax.nn.gelu(nn.project(z, self.proj_1[...]), approximate=True)
    e = self.out_norm(nn.project(z, self.proj_2[...]))  # fp32 [N, M, D]
    e = sharding.constrain(e, ("activation_batch", None, "activation_embed"))
    e, mask = patches.compact_tokens(e, sizes, gh // 2, gw // 2, p)
    e = sharding.constrain(e, ("activation_batch", None, "activation_embed"))
    return e, mask

  def encode(self, images: ImageBatch) -> tuple[jax.Array, jax.Array]:
    """`self(images.pixels, images.sizes)`.

    Raises:
      TypeError: images is not an `ImageBatch` (`check_images`).
    """
    check_images(images, ImageBatch)
    return self(images.pixels, images.sizes)

  def encode_packed(self, images: PackedImages) -> tuple[jax.Array, jax.Array]:
    """Encode packed rows of patches (NaViT packing; `patches.PackedImages`).

    Args:
      images: patches [R, L, p*p*3] (uint8 or normalised float), segment_ids int [R, L],
        coords int [R, L, 2]; L a multiple of 4, each image's patches merge-cell-major.

    Returns:
      (tokens fp32 [R, L/4, D], valid bool [R, L/4]): merged cell c of row r is token c; its
      image is segment_ids[r, 4c]. Each patch attends only to its own image's patches, with
      2D RoPE at its own (row, col), so an image's tokens do not depend on what else its row
      holds. Shapes depend only on (R, L): one compile for every mix of image sizes.

      With cfg.vision_prefix_buckets = n > 1 the encoder runs on the first L / 2^j slots of
      every row, j the largest of 0 .. n-1 whose prefix holds every non-empty slot of the
      batch (`lax.switch` over n static shapes, picked on the device); the tokens past that
      prefix are 0 and not valid. The valid tokens are those of the whole-L encoder up to
      rounding (the same patches, attention within the same images): the compute follows how
      far the batch's images reach instead of L (the small preset's rows have 8,192 slots,
      the images of its first batch fill at most 1,792 of them). Each branch is checkpointed
      (its forward runs again in the backward pass; it keeps only its inputs).

    Raises:
      TypeError: images is not a `PackedImages` (`check_images`).
      ValueError: L not a multiple of 4 (of 4 x 2^(n-1) with n prefix buckets) or
        inconsistent shapes.
    """
    check_images(images, PackedImages)
    cfg = self.cfg
    p = cfg.vision_patch_size
    x, seg, coords = images.patches, images.segment_ids, images.coords
    R, L = seg.shape
    if L % 4 or x.shape != (R, L, p * p * 3) or coords.shape != (R, L, 2):
      raise ValueError(f"VisionEncoder.encode_packed: patches {x.shape} must be [R, L, {p*p*3}] "
                       f"with L % 4 == 0, segment_ids {seg.shape} [R, L], coords "
                       f"{coords.shape} [R, L, 2]")
    n = cfg.vision_prefix_buckets
    valid = seg[:, ::4] > 0
    if n == 1:
      return self._encode_slots(x, seg, coords), valid
    if L % (4 << (n - 1)):
      raise ValueError(f"VisionEncoder.encode_packed: L={L} patch slots must be a multiple of "
                       f"4 x 2^{n - 1} = {4 << (n - 1)} for vision_prefix_buckets={n}; set "
                       "DataConfig.image_patches_per_row to such a multiple or lower the "
                       "buckets")
    sizes = [L >> j for j in reversed(range(n))]  # ascending: L/2^(n-1), ..., L/2, L

    def prefix(m):
      # Checkpointed: under autodiff a switch keeps the residuals of every branch (they differ
      # in shape, so none are shared), about twice the whole-row encoder's; this way each
      # branch keeps only its inputs, the same arrays in all branches, and recomputes its
      # forward in the backward pass.
      @jax.checkpoint
      def run(x, seg, coords):
        e = self._encode_slots(x[:, :m], seg[:, :m], coords[:, :m])
        return jnp.pad(e, ((0, 0), (0, (L - m) // 4), (0, 0)))
      return run
    e = jax.lax.switch(prefix_branch(seg, sizes), [prefix(m) for m in sizes], x, seg, coords)
    return e, valid

  def _encode_slots(self, x, seg, coords):
    """The encoder on packed slots: x [R, L, p*p*3], seg int [R, L], coords int [R, L, 2]
    -> tokens fp32 [R, L/4, D] (see `encode_packed`)."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    R, L = seg.shape
    if x.dtype == jnp.uint8:
      x = image_data.normalize(x)
    x = jnp.where((seg > 0)[..., None], x, 0.0).astype(dt)
    x = nn.project(x, self.patch_embed[...], out_dtype=jnp.float32)
    x = sharding.constrain(x, ("activation_batch", None, "activation_embed"))
    cos, sin = rope_2d_angles(coords, cfg.vision_width // cfg.vision_heads)
    x = self._run_blocks(x, cos, sin, seg > 0, seg)
    z = self.final_norm(x).astype(dt).reshape(R, L // 4, 4 * cfg.vision_width)
    z = jax.nn.gelu(nn.project(z, self.proj_1[...]), approximate=True)
    e = self.out_norm(nn.project(z, self.proj_2[...]))  # fp32 [R, L/4, D]
    return sharding.constrain(e, ("activation_batch", None, "activation_embed"))

  def embed_into(self, text_embeddings: jax.Array, tokens: jax.Array,
                 images: ImageBatch | PackedImages,
                 image_token_id: int = merge.IMAGE_TOKEN_ID) -> jax.Array:
    """Encode `images` and splice them into the `<image>` spans of the text embeddings.

    text_embeddings [B, T, D], tokens [B, T] int -> [B, T, D] in text_embeddings.dtype. With
    an `ImageBatch`, images fill the spans in reading order over the batch
    (`merge.merge_image_embeddings`); with `PackedImages` (R = B rows, what the data pipeline
    feeds), row b's images fill row b's spans (`merge.merge_rows`), so the splice stays within
    a batch shard. The one call the decoder needs:
    `x = self.embed(tokens); x = self.vision.embed_into(x, tokens, images)`.

    Raises:
      TypeError: images is neither an `ImageBatch` nor a `PackedImages` (e.g. a bare pixel
        array or a (pixels, sizes) tuple given as `model(tokens, images=...)`).
    """
    check_images(images, (ImageBatch, PackedImages))
    if isinstance(images, PackedImages):
      e, valid = self.encode_packed(images)
      return merge.merge_rows(text_embeddings, tokens, e, valid, image_token_id)
    e, mask = self.encode(images)
    return merge.merge_image_embeddings(text_embeddings, tokens, e, mask, image_token_id)
