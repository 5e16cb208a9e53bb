"""Inference: chunked prefill, cached decode, batched sampling and multi-turn state reuse.

    from sparse_lm.inference import Engine, SamplingParams
    engine = Engine(model, max_length=4096, max_batch=8)
    outs = engine.generate(prompts, max_new_tokens=32, sampling=SamplingParams(temperature=0.0))

See engine.py (scheduling, API), forward.py (the decoder from a cache), cache.py (what is
cached and `cache_bytes`), sampling.py, and docs/inference.md.
"""

from sparse_lm.inference.cache import cache_bytes
from sparse_lm.inference.engine import DecodeState, Engine, GenerationOutput
from sparse_lm.inference.sampling import SamplingParams

__all__ = ["DecodeState", "Engine", "GenerationOutput", "SamplingParams", "cache_bytes"]
