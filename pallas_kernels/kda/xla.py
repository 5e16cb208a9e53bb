"""Chunked KDA in pure jax.numpy. PLACEHOLDER: delegates to the reference until written."""

from pallas_kernels.kda import reference


def chunk_kda_xla(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  segment_ids=None, chunk_size=64):
  o, S = reference.recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 segment_ids=segment_ids)
  return o, (S if output_final_state else None)
