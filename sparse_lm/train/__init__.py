"""Training: optimizer.py (AdamW + WSD), state.py (TrainState), step.py (train/eval steps),
checkpoint.py (Orbax), loop.py (`run(stage, workdir)`), metrics.py (TensorBoard, progress bar,
MFU), sample.py (end-of-stage sample), config.py (StageConfig)."""
