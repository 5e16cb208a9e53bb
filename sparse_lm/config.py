"""Model configuration: one frozen dataclass and the three presets (ARCHITECTURE.md §1).

`get_preset("full")` reproduces the 2.8T / 104B-active configuration; `small` fits one GPU;
`tiny` runs forward+backward in seconds on a laptop CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

ResidualKind = Literal["attnres_block", "attnres_full", "standard"]
BalancerKind = Literal["quantile", "bias_sign", "aux_loss", "none"]
RematPolicy = Literal["none", "full", "save_dots", "save_qkv_proj", "minimal", "save_kda",
                      "save_kda_experts"]

# Every closed set of choices of the model, defined here once and validated in
# `ModelConfig.validate` (the modules that act on a choice import these tuples).
RESIDUAL_KINDS = ("attnres_block", "attnres_full", "standard")
BALANCER_KINDS = ("quantile", "bias_sign", "aux_loss", "none")
QB_CUTOFFS = ("midpoint", "kplus1")  # moe/router.route: alpha between z_(k), z_(k+1), or z_(k+1)
REMAT_POLICIES = ("none", "full", "save_dots", "save_qkv_proj", "minimal", "save_kda",
                  "save_kda_experts")
# pallas_kernels.kda backends ("auto": pallas_tpu on TPU, pallas_gpu on Hopper, else xla).
KDA_BACKENDS = ("auto", "xla", "reference", "pallas_tpu", "pallas_gpu")
GMM_BACKENDS = ("auto", "ragged_dot", "tokamax", "megablox", "blocked", "dense")
FFN_ACTIVATIONS = ("situ", "swiglu")
ATTENTION_BACKENDS = ("auto", "xla_chunked", "xla", "tokamax", "cudnn", "splash")
# moe/expert_parallel: the token exchange of expert parallelism ("auto": allgather when the
# expert axis is smaller than top-k, else ragged on GPU / TPU and dense on CPU).
EP_EXCHANGES = ("auto", "ragged", "dense", "allgather")
STACK_DTYPES = ("bfloat16", "float32")
# The inference engine's decode step (sparse_lm/inference/fused.py): "pallas" fuses each layer's
# small ops into Pallas kernels (pallas_kernels.decode; interpret mode off the GPU), "xla" is
# the pure-JAX path, "auto" picks pallas on a GPU when the shapes allow it, else xla.
DECODE_BACKENDS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Every architecture field of the model (ARCHITECTURE.md §1-§7).

  Layer layout: layer i is Gated MLA when (i + 1) % mla_every == 0 or i == num_layers - 1
  (the last layer is MLA), else KDA. Layer 0 uses the dense SiTU-GLU FFN; all others LatentMoE.
  num_layers = 1 mod mla_every gives whole groups plus the last layer (93, 9); other values
  add KDA layers before the last one (Kimi-Linear-48B: 27 layers, mla_every 4).
  """

  name: str = "custom"
  vocab_size: int = 163_840
  d_model: int = 7168
  num_layers: int = 93
  mla_every: int = 4
  num_dense_layers: int = 1

  # KDA (§2)
  kda_num_heads: int = 96
  kda_head_dim: int = 128  # K
  kda_value_dim: int = 128  # V
  kda_conv_size: int = 4
  kda_gate_lower_bound: float | None = -5.0  # None = unbounded softplus gate
  kda_chunk_size: int = 64
  kda_backend: str = "auto"
  kda_output_gate_rank: int = 0  # 0 = full-rank w_og [D,H,V]; r > 0 = w_og_down [D,r] w_og_up

  # Gated MLA (§3), NoPE: the "rope" part is never rotated.
  mla_num_heads: int = 96
  q_lora_rank: int = 1536  # 0 = no query LoRA: one w_q [D, H, nope+rope] (Kimi-Linear)
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  attention_backend: str = "auto"
  attention_chunk_size: int = 512  # query/key block of the memory-efficient XLA path
  mla_output_gate: bool = True  # G1 sigmoid gate before W_o (False: Kimi-Linear's plain MLA)
  # Record each MLA head's largest attention logit of a training step in a non-Param variable
  # (`attn_logit_max`, read and reset by QK-clip, sparse_lm/train/optimizer.py).
  mla_logit_max: bool = False

  # Dense FFN (layer 0) and SiTU-GLU (§5)
  dense_hidden: int = 33_792
  situ_beta1: float = 4.0
  situ_beta2: float = 25.0
  ffn_activation: str = "situ"  # "situ" (SiTU-GLU) or "swiglu" (silu(g) * u): every GLU FFN

  # Stable LatentMoE (§5)
  num_experts: int = 896
  experts_per_token: int = 16
  moe_latent_dim: int = 3584
  expert_hidden: int = 3072
  num_shared_experts: int = 2
  shared_expert_hidden: int = 3072
  route_scale: float = 1.0  # HF routed_scaling_factor
  moe_latent: bool = True  # False: routed experts on the full width (no W_down/norm/W_up)
  # Single-program cap: each expert keeps ceil(capacity_factor * N * k / E) assignments.
  capacity_factor: float | None = None  # None = dropless
  gmm_backend: str = "auto"
  # Expert parallelism (mesh axis `expert` > 1, moe/expert_parallel.py): the exchange and the
  # per-rank receive buffer in units of the mean rows n * k (n tokens per device), MaxText's
  # name. None = dropless (worst-case buffers of P * n * k rows). Both caps drop by the causal
  # rule of docs/architecture.md ("Capacity drops").
  ep_exchange: str = "auto"
  ragged_buffer_factor: float | None = None

  # Balancing (§6)
  balancer: str = "quantile"
  balancer_bins: int = 1000
  bias_sign_rate: float = 1e-3
  aux_loss_coef: float = 1e-2
  qb_cutoff: str = "midpoint"  # QB_CUTOFFS

  # Residual stream (§4)
  residual: str = "attnres_block"
  attnres_block_layers: int = 12
  # Storage dtype of the committed AttnRes sources (mixing is fp32 either way); None = the
  # compute dtype. bf16 halves the stack saved at every group boundary (model/attnres.py).
  attnres_stack_dtype: str | None = None

  # Inference
  decode_backend: str = "auto"  # DECODE_BACKENDS

  # Vision (§7)
  vision: bool = False  # True in `small` and `full`; `tiny` is text-only unless asked
  vision_patch_size: int = 14
  vision_width: int = 1152
  vision_layers: int = 27
  vision_heads: int = 16
  vision_mlp: int = 4304
  # Packed rows run the encoder on the shortest of this many prefixes of their L patch slots
  # (L, L/2, L/4, ...) that holds every image of the batch, chosen on the device
  # (`VisionEncoder.encode_packed`); 1 = always all L slots.
  vision_prefix_buckets: int = 1

  # Numerics and memory
  norm_eps: float = 1e-6  # RMSNorm epsilon (pre-norms, final norm, KDA o_norm, latent norm)
  mla_norm_eps: float | None = None  # MLA q/kv latent RMSNorms; None = norm_eps
  l2_norm_eps: float = 1e-6  # KDA q/k L2 norm, inside the square root
  dtype: str = "bfloat16"  # compute dtype
  param_dtype: str = "float32"  # master weights
  remat_policy: str = "full"
  # Layer units nearest the output that run without rematerialisation (their activations kept
  # for the backward pass): memory for one forward pass of those layers. Units, counted from
  # the output end: the last layer, each tail layer, each scanned group of mla_every layers
  # (the last first), the head group (`Transformer.remat_units`). 0 = every unit follows
  # remat_policy; ignored when remat_policy is "none".
  remat_skip_last: int = 0
  scan_layers: bool = True
  loss_chunk_size: int = 2048  # tokens per chunk of the chunked cross-entropy
  # dtype of the logits' cotangent in the LM head's two backward GEMMs: None = fp32 (exact
  # autodiff; XLA:GPU runs those GEMMs as TF32), "bfloat16" = rounded once, bf16 GEMMs with
  # fp32 accumulation (`model.loss.chunked_cross_entropy`).
  lm_head_grad_dtype: str | None = None
  init_std: float = 0.02

  def __post_init__(self):
    self.validate()

  # ---------------------------------------------------------------- layout helpers
  @property
  def layer_types(self) -> tuple[str, ...]:
    """'kda' or 'mla' per layer."""
    return tuple(
        "mla" if ((i + 1) % self.mla_every == 0 or i == self.num_layers - 1) else "kda"
        for i in range(self.num_layers))

  @property
  def num_kda_layers(self) -> int:
    return self.layer_types.count("kda")

  @property
  def num_mla_layers(self) -> int:
    return self.layer_types.count("mla")

  @property
  def num_moe_layers(self) -> int:
    return self.num_layers - self.num_dense_layers

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def glu_betas(self) -> tuple[float | None, float | None]:
    """(beta1, beta2) for `situ_activation`: the SiTU clip levels, or (None, None) = SwiGLU."""
    if self.ffn_activation == "swiglu":
      return None, None
    return self.situ_beta1, self.situ_beta2

  @property
  def num_remat_units(self) -> int:
    """Units the stack is rematerialised in: the head group, the scanned groups, the tail
    layers and the last layer (`transformer.py`'s module docstring)."""
    groups = (self.num_layers - 1) // self.mla_every  # including the head group
    tail = self.num_layers - 1 - groups * self.mla_every
    return 1 + max(groups - 1, 0) + tail + 1

  @property
  def num_attnres_blocks(self) -> int:
    return -(-self.num_layers // self.attnres_block_layers)

  # ---------------------------------------------------------------- validation
  def validate(self) -> None:
    """Raise ValueError naming the offending fields."""
    def bad(msg):
      raise ValueError(f"ModelConfig({self.name}): {msg}")

    for f in ("vocab_size", "d_model", "num_layers", "kda_num_heads", "kda_head_dim",
              "kda_value_dim", "mla_num_heads", "kv_lora_rank",
              "qk_nope_head_dim", "v_head_dim", "dense_hidden", "num_experts",
              "experts_per_token", "moe_latent_dim", "expert_hidden", "mla_every",
              "attnres_block_layers", "kda_conv_size", "balancer_bins", "loss_chunk_size"):
      if getattr(self, f) <= 0:
        bad(f"{f}={getattr(self, f)} must be > 0")
    for f in ("attention_chunk_size", "norm_eps", "l2_norm_eps", "init_std", "route_scale",
              "situ_beta1", "situ_beta2"):
      if not getattr(self, f) > 0:  # also refuses NaN
        bad(f"{f}={getattr(self, f)} must be > 0")
    for f in ("bias_sign_rate", "aux_loss_coef"):
      if not getattr(self, f) >= 0:
        bad(f"{f}={getattr(self, f)} must be >= 0 (0 turns it off)")
    if self.num_shared_experts and self.shared_expert_hidden <= 0:
      bad(f"shared_expert_hidden={self.shared_expert_hidden} must be > 0 with "
          f"num_shared_experts={self.num_shared_experts}")
    if self.vision:
      for f in ("vision_patch_size", "vision_width", "vision_layers", "vision_heads",
                "vision_mlp"):
        if getattr(self, f) <= 0:
          bad(f"{f}={getattr(self, f)} must be > 0 (or vision=false)")
    if self.qk_rope_head_dim < 0 or self.num_shared_experts < 0:
      bad("qk_rope_head_dim and num_shared_experts must be >= 0")
    if self.q_lora_rank < 0:
      bad(f"q_lora_rank={self.q_lora_rank} must be >= 0 (0 = no query LoRA)")
    if self.kda_output_gate_rank < 0:
      bad(f"kda_output_gate_rank={self.kda_output_gate_rank} must be >= 0 (0 = full rank)")
    if self.ffn_activation not in FFN_ACTIVATIONS:
      bad(f"ffn_activation={self.ffn_activation!r} must be one of {FFN_ACTIVATIONS}")
    if self.experts_per_token > self.num_experts:
      bad(f"experts_per_token={self.experts_per_token} > num_experts={self.num_experts}; "
          "top-k cannot exceed the number of routed experts")
    if self.num_dense_layers < 0 or self.num_dense_layers >= self.num_layers:
      bad(f"num_dense_layers={self.num_dense_layers} must be in [0, num_layers)")
    if self.kda_gate_lower_bound is not None and not -5.0 <= self.kda_gate_lower_bound < 0:
      bad(f"kda_gate_lower_bound={self.kda_gate_lower_bound} must be in [-5, 0) or None "
          "(unbounded gate); below -5 a 16-token tile can overflow fp32")
    if self.kda_head_dim > 256:
      bad(f"kda_head_dim={self.kda_head_dim} > 256 is not supported by the KDA kernels")
    if self.kda_chunk_size not in (16, 32, 64):
      bad(f"kda_chunk_size={self.kda_chunk_size} must be 64, 32 or 16")
    if self.residual not in RESIDUAL_KINDS:
      bad(f"residual={self.residual!r} must be one of {RESIDUAL_KINDS}")
    if self.balancer not in BALANCER_KINDS:
      bad(f"balancer={self.balancer!r} must be one of {BALANCER_KINDS}")
    if self.remat_policy not in REMAT_POLICIES:
      bad(f"remat_policy={self.remat_policy!r} must be one of {REMAT_POLICIES}")
    if not 0 <= self.remat_skip_last <= self.num_remat_units:
      bad(f"remat_skip_last={self.remat_skip_last} must be in [0, {self.num_remat_units}] "
          f"(the model's layer units: {self.num_remat_units})")
    if self.kda_backend not in KDA_BACKENDS:
      bad(f"kda_backend={self.kda_backend!r} cannot run; choose one of {KDA_BACKENDS}")
    if self.qb_cutoff not in QB_CUTOFFS:
      bad(f"qb_cutoff={self.qb_cutoff!r} must be one of {QB_CUTOFFS}")
    if self.ep_exchange not in EP_EXCHANGES:
      bad(f"ep_exchange={self.ep_exchange!r} must be one of {EP_EXCHANGES}")
    if self.ragged_buffer_factor is not None and self.ragged_buffer_factor <= 0:
      bad(f"ragged_buffer_factor={self.ragged_buffer_factor} must be > 0 or None (dropless)")
    if self.attnres_stack_dtype is not None and self.attnres_stack_dtype not in STACK_DTYPES:
      bad(f"attnres_stack_dtype={self.attnres_stack_dtype!r} must be one of {STACK_DTYPES} "
          "or None (the compute dtype)")
    if self.lm_head_grad_dtype not in (None, "bfloat16"):
      bad(f"lm_head_grad_dtype={self.lm_head_grad_dtype!r} must be None (fp32) or 'bfloat16'")
    if self.decode_backend not in DECODE_BACKENDS:
      bad(f"decode_backend={self.decode_backend!r} must be one of {DECODE_BACKENDS}")
    if self.gmm_backend not in GMM_BACKENDS:
      bad(f"gmm_backend={self.gmm_backend!r} must be one of {GMM_BACKENDS}")
    if self.attention_backend not in ATTENTION_BACKENDS:
      bad(f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")
    if self.capacity_factor is not None and self.capacity_factor <= 0:
      bad(f"capacity_factor={self.capacity_factor} must be > 0 or None (dropless)")
    if self.dtype not in ("bfloat16", "float32") or self.param_dtype not in ("bfloat16",
                                                                             "float32"):
      bad(f"dtype={self.dtype!r}, param_dtype={self.param_dtype!r}: use bfloat16 or float32")
    if self.layer_types[-1] != "mla" or self.layer_types[0] != "kda":
      bad(f"num_layers={self.num_layers}, mla_every={self.mla_every}: the first layer must be "
          "KDA and the last MLA")
    if self.num_layers < self.mla_every + 1:
      bad(f"num_layers={self.num_layers} must be > mla_every={self.mla_every} (a first group of "
          f"{self.mla_every - 1} KDA + 1 MLA, plus a final MLA layer)")
    if self.residual == "attnres_block" and self.attnres_block_layers % self.mla_every:
      bad(f"attnres_block_layers={self.attnres_block_layers} must be a multiple of "
          f"mla_every={self.mla_every} so blocks align with the scanned layer groups")
    if self.vision and self.d_model % 2:
      bad("vision requires an even d_model")
    buckets = self.vision_prefix_buckets
    if not isinstance(buckets, int) or not 1 <= buckets <= 8:
      bad(f"vision_prefix_buckets={self.vision_prefix_buckets!r} must be an int in [1, 8] "
          "(1 = the encoder always runs on all patch slots)")
    if self.num_dense_layers > self.mla_every:
      bad(f"num_dense_layers={self.num_dense_layers} > mla_every={self.mla_every}: the dense "
          "FFN layers must all sit in the first (unrolled) layer group")

  def check_segment_ids(self) -> None:
    """Raise ValueError if a chosen backend cannot take packed segment ids (training always
    passes them: `model/loss.py`). Called by the training stage's validation."""
    if self.attention_backend == "cudnn":
      raise ValueError(
          f"ModelConfig({self.name}): attention_backend='cudnn' cannot run with segment ids "
          "(packed documents, which training always has); choose one of "
          f"{tuple(b for b in ATTENTION_BACKENDS if b != 'cudnn')}")


def _full() -> ModelConfig:
  # Natively multimodal (§7): the 27-layer SigLIP-so400m-shaped ViT (width 1152, 16 heads,
  # MLP 4304, patch 14; 466M with its projector), trained with the LM from the first stage.
  return ModelConfig(name="full", vision=True)


def _small() -> ModelConfig:
  # ~1.6B total, ~0.3B active: fits one 80-141 GB GPU with AdamW at 8K tokens.
  return ModelConfig(
      name="small", vocab_size=32_768, d_model=1024, num_layers=17,
      kda_num_heads=8, kda_head_dim=128, kda_value_dim=128,
      mla_num_heads=8, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=128,
      qk_rope_head_dim=64, v_head_dim=128,
      dense_hidden=4096, num_experts=64, experts_per_token=4, moe_latent_dim=512,
      expert_hidden=1024, num_shared_experts=1, shared_expert_hidden=2048,
      attnres_block_layers=4, remat_policy="full",
      # a ViT-B-sized encoder: width 768, 12 layers, 12 heads, MLP 3072 (98M with projector)
      vision=True, vision_width=768, vision_layers=12, vision_heads=12, vision_mlp=3072,
      # the encoder on 1,024-8,192 of the 8,192 patch slots, as far as the batch's images
      # reach: its share of the H200 step 387.5 -> 78.6 ms (docs/benchmarks.md, 2026-12-01)
      vision_prefix_buckets=4)


def _tiny() -> ModelConfig:
  # Seconds per forward+backward on 2 CPU cores; every code path of `full` is exercised.
  return ModelConfig(
      name="tiny", vocab_size=512, d_model=64, num_layers=9,
      kda_num_heads=2, kda_head_dim=32, kda_value_dim=32, kda_chunk_size=16,
      mla_num_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
      qk_rope_head_dim=8, v_head_dim=16,
      dense_hidden=128, num_experts=8, experts_per_token=2, moe_latent_dim=32,
      expert_hidden=64, num_shared_experts=1, shared_expert_hidden=64,
      attnres_block_layers=4, balancer_bins=256, dtype="float32", remat_policy="none",
      loss_chunk_size=256, attention_chunk_size=64)


PRESETS = {"tiny": _tiny, "small": _small, "full": _full}


def get_preset(name: str, /, **overrides) -> ModelConfig:
  """A preset by name ("tiny", "small", "full"), with optional field overrides.

  Raises:
    ValueError: unknown preset name or unknown override field.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
  cfg = PRESETS[name]()
  if overrides:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
      raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid: {sorted(fields)}")
    cfg = dataclasses.replace(cfg, **overrides)
  return cfg


def model_config_from_json(d: dict) -> ModelConfig:
  """The ModelConfig saved as JSON (`dataclasses.asdict`) in a checkpoint's meta; keys of
  fields removed since are dropped, fields added since take their defaults."""
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  return ModelConfig(**{k: v for k, v in d.items() if k in names})
