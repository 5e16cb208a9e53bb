"""Training: optimizer.py (AdamW + WSD), state.py (TrainState), step.py (train/eval steps),
builder.py (what a stage compiles), checkpoint.py (Orbax, configs saved with a checkpoint),
loop.py (`run(stage, workdir)`), metrics.py (TensorBoard, metrics.jsonl, progress, MFU, routing
health), workdir.py (the run lock), sample.py (end-of-stage sample), config.py (StageConfig),
trained.py (`load(workdir, stage=None) -> (model, tokenizer, stage_config)`).

`sparse_lm.train.load` is imported on first use (importing the package stays cheap).
"""


def __getattr__(name):
  if name == "load":
    from sparse_lm.train.trained import load  # pylint: disable=g-import-not-at-top
    return load
  raise AttributeError(f"module 'sparse_lm.train' has no attribute {name!r}")
