"""The configuration of one training stage (ARCHITECTURE.md §8): a frozen dataclass.

Experiments (`experiments/stage_*.py`) declare one `StageConfig` per preset, each derived from
the previous stage with `dataclasses.replace`; `sparse_lm.train.loop.run` executes one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparse_lm.config import ModelConfig, get_preset
from sparse_lm.data import DataConfig
from sparse_lm.sharding import MeshLayout, topology_devices
from sparse_lm.train.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """One stage of the context curriculum.

  Attributes:
    name: the stage's directory under the workdir (`<workdir>/<name>/`).
    preset: model preset ("tiny", "small", "full"); `model_overrides` replace its fields.
    seq_len: tokens per packed training row.
    tokens_per_batch: tokens per optimizer step (all micro-batches, all hosts); the global
      batch is tokens_per_batch // seq_len sequences.
    micro_batches: gradient-accumulation steps per optimizer step.
    steps: optimizer steps of this stage (the schedule's length).
    optim: AdamW and its warmup-stable-decay schedule.
    eval_every / eval_batches: held-out evaluation period (steps) and size (batches of
      `eval_batch_size` rows, default the global batch).
    checkpoint_every / keep_checkpoints: save period (steps) and how many to keep.
    mesh: device-mesh layout (a `context` axis for the long stages; `expert_shards="context"`
      when the sequences per micro-batch are fewer than the expert-parallel degree).
    topology / num_slices: the TPU slice shape the `mesh` is planned for (e.g. "v5p:8x16x16",
      a shape Google offers, `sharding.check_topology`) and how many such slices over DCN (the
      mesh's `dcn_*` sizes multiply to it); `launch.aot_plan` compiles for it by default.
      None for presets not planned for a TPU slice.
    init_from: the stage (by name, in the same workdir) whose final checkpoint initialises
      this one when it has no checkpoint of its own; or a directory W holding a Hugging Face
      import (`python -m sparse_lm.interop.hf import --hf_dir D --workdir W`): then the model
      is the imported ModelConfig with `model_overrides` applied (`preset` is not used) and
      training starts from its weights with a fresh optimizer; None = from scratch.
    keep_optimizer_state: carry the AdamW moments over from `init_from` (§8: by default yes).
    reference_seq_len: the length the stage has at full scale (printed when a preset scales
      it down).
    nan_at_step: fault injection for tests; makes that step's loss NaN.
    gpu_autotune: let XLA autotune the GPU kernels of the train and eval steps (matmul tile
      configs; `xla_gpu_autotune_level`). False compiles them with the compiler's default
      configs: on one H200 the tiny train step's XLA compile spent 13.3 s of its 38 s
      autotuning, for a step that is bound by kernel launches (docs/benchmarks.md). Ignored
      off GPUs.
    gc_every: steps between the step loop's full garbage collections. From the first step
      on, the loop freezes what lives then (`gc.freeze`) and turns Python's automatic
      collector off, so that no collection of the whole heap stalls a step; every `gc_every`
      steps it collects what is not frozen (`loop._StepGC`). 0 leaves the collector as it
      is (`benchmarks/loop_gc.py` compares the two).
  """

  name: str
  preset: str = "tiny"
  model_overrides: tuple[tuple[str, Any], ...] = ()
  seq_len: int = 8192
  tokens_per_batch: int = 8192 * 64
  micro_batches: int = 1
  steps: int = 1000
  optim: OptimizerConfig = OptimizerConfig()
  z_loss_coef: float = 1e-4
  eval_every: int = 250
  eval_batches: int = 4
  eval_batch_size: int | None = None
  checkpoint_every: int = 500
  keep_checkpoints: int = 3
  mesh: MeshLayout = MeshLayout()
  topology: str | None = None
  num_slices: int = 1
  data: DataConfig = DataConfig()
  init_from: str | None = None
  keep_optimizer_state: bool = True
  seed: int = 0
  sample_tokens: int = 48
  sample_prompt: str = "def "
  reference_seq_len: int | None = None
  nan_at_step: int | None = None
  gpu_autotune: bool = True
  gc_every: int = 100

  @property
  def global_batch(self) -> int:
    """Sequences per optimizer step."""
    return max(1, self.tokens_per_batch // self.seq_len)

  def model_config(self) -> ModelConfig:
    from sparse_lm.interop import workdir as hf_import  # pylint: disable=g-import-not-at-top
    overrides = dict(self.model_overrides)
    if self.optim.qk_clip_threshold is not None:  # QK-clip reads each MLA head's max logit
      overrides["mla_logit_max"] = True
    imported = hf_import.imported_config(self.init_from)
    if imported is not None:
      return dataclasses.replace(imported, **overrides)
    return get_preset(self.preset, **overrides)

  def validate(self) -> None:
    """Raise ValueError naming the offending field."""
    for f in ("seq_len", "tokens_per_batch", "micro_batches", "steps", "eval_every",
              "checkpoint_every", "keep_checkpoints"):
      if getattr(self, f) <= 0:
        raise ValueError(f"StageConfig({self.name}): {f}={getattr(self, f)} must be > 0")
    if self.eval_batches < 1:
      raise ValueError(f"StageConfig({self.name}): eval_batches={self.eval_batches} must be "
                       ">= 1 (to evaluate less often, raise eval_every)")
    if self.eval_batch_size is not None and self.eval_batch_size < 1:
      raise ValueError(f"StageConfig({self.name}): eval_batch_size={self.eval_batch_size} "
                       "must be >= 1 or None (the training batch)")
    if self.gc_every < 0:
      raise ValueError(f"StageConfig({self.name}): gc_every={self.gc_every} must be >= 0 "
                       "(0 leaves Python's garbage collector as it is)")
    self.optim.validate()
    if self.tokens_per_batch % self.seq_len:
      raise ValueError(f"StageConfig({self.name}): tokens_per_batch={self.tokens_per_batch} "
                       f"is not a multiple of seq_len={self.seq_len}")
    if self.global_batch % self.micro_batches:
      raise ValueError(f"StageConfig({self.name}): global batch {self.global_batch} sequences "
                       f"does not divide into micro_batches={self.micro_batches}")
    if self.topology is not None:
      try:
        self.mesh.resolve(topology_devices(self.topology, self.num_slices), self.num_slices)
      except ValueError as e:
        raise ValueError(f"StageConfig({self.name}): topology={self.topology!r} x num_slices="
                         f"{self.num_slices}, mesh={self.mesh}: {e} (or set topology=None "
                         "to train without a planned TPU slice)") from None
    model = self.model_config()
    model.check_segment_ids()  # validates the overrides; training packs
    if self.data.images and not model.vision:
      raise ValueError(f"StageConfig({self.name}): data.images={self.data.images!r} needs a "
                       "model with a vision encoder: set model.vision=true")
