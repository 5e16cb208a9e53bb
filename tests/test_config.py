"""ModelConfig validation: every closed set of choices is checked before anything is built,
and the error names the field and the choices (or the fix)."""

import jax.numpy as jnp
import pytest

from sparse_lm import config
from sparse_lm.config import get_preset


@pytest.mark.parametrize("field, value, match", [
    ("kda_backend", "triton", r"kda_backend='triton' cannot run; choose one of \('auto', 'xla', "
     r"'reference', 'pallas_tpu', 'pallas_gpu'\)"),
    ("qb_cutoff", "median", r"qb_cutoff='median' must be one of \('midpoint', 'kplus1'\)"),
    ("ep_exchange", "fast", r"ep_exchange='fast' must be one of \('auto', 'ragged', 'dense', "
     r"'allgather'\)"),
    ("ragged_buffer_factor", 0.0, "ragged_buffer_factor=0.0 must be > 0 or None"),
    ("attnres_stack_dtype", "float16", "attnres_stack_dtype='float16' must be one of"),
    ("remat_policy", "some", "remat_policy='some' must be one of"),
    ("balancer", "loss", "balancer='loss' must be one of"),
    ("num_dense_layers", 5, "num_dense_layers=5 > mla_every=4"),
])
def test_bad_choice_names_field_and_choices(field, value, match):
  with pytest.raises(ValueError, match=match):
    get_preset("tiny", **{field: value})


def test_cudnn_refused_where_segment_ids_are_given():
  cfg = get_preset("tiny", attention_backend="cudnn")  # valid without packed documents
  with pytest.raises(ValueError, match="attention_backend='cudnn' cannot run with segment ids"):
    cfg.check_segment_ids()
  get_preset("tiny").check_segment_ids()


def test_new_fields_take_effect():
  from sparse_lm.model import attnres  # pylint: disable=g-import-not-at-top
  cfg = get_preset("small")
  assert attnres.stack_dtype(cfg) == jnp.bfloat16  # default: the compute dtype
  assert attnres.stack_dtype(get_preset("small", attnres_stack_dtype="float32")) == jnp.float32
  assert config.QB_CUTOFFS[0] == get_preset("full").qb_cutoff == "midpoint"
  assert get_preset("full").ragged_buffer_factor is None  # dropless unless a stage caps it
