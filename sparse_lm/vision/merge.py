"""Splice image embeddings into the text embedding sequence (ARCHITECTURE.md §7).

A text sequence holds, for each image, a span of `<image>` placeholder ids exactly as long as
the image's token count (`num_image_tokens(h, w, p)`, `image_token_span`). The k-th
placeholder in reading order over the batch (row-major over [B, T]) receives the k-th valid
image token, image tokens taken in order: image 0's valid tokens, then image 1's, ... So N
images are consumed in reading order, one span each (a span normally lies inside one row; one
that runs past the end of a row continues on the next). The loss must skip image positions:
`image_placeholder_mask(targets, IMAGE_TOKEN_ID)` marks the targets that are placeholders.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Id of `<image>`: index 3 of sparse_lm.data.tokenizer.SPECIAL_TOKENS (fixed for every
# tokenizer the project trains; tests/vision checks the two agree). A constant here because
# the model side may not import sparse_lm.data.
IMAGE_TOKEN_ID = 3


def image_placeholder_mask(tokens: jax.Array, image_token_id: int = IMAGE_TOKEN_ID) -> jax.Array:
  """bool [B, T]: True where tokens [B, T] is the `<image>` placeholder.

  Use its negation as (part of) the loss mask on targets: no loss on image positions.
  """
  return tokens == image_token_id


def merge_image_embeddings(text_embeddings: jax.Array, tokens: jax.Array,
                           image_embeddings: jax.Array, image_mask: jax.Array,
                           image_token_id: int = IMAGE_TOKEN_ID) -> jax.Array:
  """Replace the `<image>` placeholder positions of the text embeddings by image tokens.

  Args:
    text_embeddings: [B, T, D] (any float dtype; the output keeps it).
    tokens: [B, T] int token ids.
    image_embeddings: [N, M, D] per-image tokens (VisionEncoder output).
    image_mask: bool [N, M], True for valid image tokens (VisionEncoder output).
    image_token_id: the placeholder id.

  Returns:
    [B, T, D]: placeholder k (reading order) holds the k-th valid image token (image-major,
    then token order); every other position is text_embeddings unchanged. Differentiable in
    both embeddings (a gather and a select). Placeholders beyond the number of valid image
    tokens keep their text embedding; surplus image tokens are dropped.

  Raises:
    ValueError: (eager calls only, when the values are concrete) the number of placeholders
      differs from the number of valid image tokens; under jit the count cannot be checked.
  """
  B, T, D = text_embeddings.shape
  N, M, D2 = image_embeddings.shape
  if D != D2 or tokens.shape != (B, T) or image_mask.shape != (N, M):
    raise ValueError(f"merge_image_embeddings: text {text_embeddings.shape}, tokens "
                     f"{tokens.shape}, image {image_embeddings.shape}, mask {image_mask.shape}")
  if N * M == 0:
    return text_embeddings
  is_img = image_placeholder_mask(tokens, image_token_id).reshape(-1)  # [B*T]
  flat_mask = image_mask.reshape(-1)
  num_valid = jnp.sum(flat_mask, dtype=jnp.int32)
  if not isinstance(is_img, jax.core.Tracer) and not isinstance(flat_mask, jax.core.Tracer):
    n_ph, n_val = int(jnp.sum(is_img)), int(num_valid)
    if n_ph != n_val:
      raise ValueError(f"merge_image_embeddings: {n_ph} <image> placeholders but {n_val} valid "
                       "image tokens; each image needs a span of num_image_tokens(h, w, p)")
  # Flat indices of the valid image tokens, in order, first (stable sort of ~mask).
  order = jnp.argsort(~flat_mask, stable=True)
  rank = jnp.cumsum(is_img.astype(jnp.int32)) - 1  # placeholder k -> k
  take = is_img & (rank < num_valid)
  src = order[jnp.clip(rank, 0, N * M - 1)]
  gathered = jnp.take(image_embeddings.reshape(N * M, D), src, axis=0)
  out = jnp.where(take[:, None], gathered.astype(text_embeddings.dtype),
                  text_embeddings.reshape(B * T, D))
  return out.reshape(B, T, D)


def merge_rows(text_embeddings: jax.Array, tokens: jax.Array, image_embeddings: jax.Array,
               image_valid: jax.Array, image_token_id: int = IMAGE_TOKEN_ID) -> jax.Array:
  """Row-wise splice for packed rows: placeholder k of row b gets valid image token k of row b.

  Args:
    text_embeddings: [B, T, D]; tokens: [B, T] int.
    image_embeddings: [B, M, D] (`VisionEncoder.encode_packed`, row b = text row b's images).
    image_valid: bool [B, M].

  Returns:
    [B, T, D] in text_embeddings.dtype; non-placeholder positions unchanged. A per-row gather
    (shards with the batch). Placeholders beyond a row's valid tokens keep their text
    embedding.

  Raises:
    ValueError: (eager calls only) a row's placeholder count differs from its valid tokens.
  """
  B, T, D = text_embeddings.shape
  if image_embeddings.shape[::2] != (B, D) or image_valid.shape != image_embeddings.shape[:2]:
    raise ValueError(f"merge_rows: text {text_embeddings.shape}, image "
                     f"{image_embeddings.shape}, valid {image_valid.shape}")
  M = image_embeddings.shape[1]
  is_img = image_placeholder_mask(tokens, image_token_id)
  num_valid = jnp.sum(image_valid, axis=1, dtype=jnp.int32)  # [B]
  if not isinstance(is_img, jax.core.Tracer) and not isinstance(image_valid, jax.core.Tracer):
    n_ph = jnp.sum(is_img, axis=1, dtype=jnp.int32)
    if bool(jnp.any(n_ph != num_valid)):
      raise ValueError(f"merge_rows: <image> placeholders per row {n_ph.tolist()} but valid "
                       f"image tokens per row {num_valid.tolist()}")
  order = jnp.argsort(~image_valid, axis=1, stable=True)  # valid tokens first, in order
  rank = jnp.cumsum(is_img.astype(jnp.int32), axis=1) - 1
  src = jnp.take_along_axis(order, jnp.clip(rank, 0, M - 1), axis=1)  # [B, T]
  gathered = jnp.take_along_axis(image_embeddings, src[..., None], axis=1)
  take = is_img & (rank < num_valid[:, None])
  return jnp.where(take[..., None], gathered.astype(text_embeddings.dtype), text_embeddings)
