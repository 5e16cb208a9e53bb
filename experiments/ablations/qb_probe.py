"""Why Quantile Balancing's per-step load is what it is: probes on a saved run's checkpoint.

  python -m experiments.ablations.qb_probe RUN_DIR [--step S] [--batches 3] [--bins 256,4096]

On real training batches (the balancing ablation's data: `data.shuffle_window` included),
capture every MoE layer's router scores s [N, E] and bias b (from its `router.route` call), then
per layer, in NumPy:
  - `spread`: the median over experts of std_i(s_ij), and the histogram's bin width
    ((max b - min b + 2) / bins) against the width of r_j = alpha_i - s_ij between its 5% and
    7.5% quantiles (the k/E = 6.25% quantile lies there for E = 64, k = 4);
  - `trained`: max/mean load of batch t under the checkpoint's bias (what training logs);
  - `same[bins]`: one QB update estimated on batch t, applied to batch t itself (an oracle: with
    the quantile placed right, each expert gets ~ m k / E), with the code's histogram
    (`sparse_lm.moe.balancing`, `bins` bins) and with the exact quantile (bins "exact");
  - `next[bins]`: the same bias applied to batch t + 1 (the step QB really takes, without the
    router moving in between); "exact x8": the exact update iterated 8 times on batch t
    (converged there), on batch t and on batch t + 1;
  - `pooled`: a bias converged (exact, 8 iterations) on the other captured batches together,
    applied to batch t: what the best bias fixed before seeing the batch does;
  - `uniform`: uniformly random routing of the same counts (the sampling floor).
Numbers: worst layer per batch, mean over the batches.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np


def capture_routing(model, tokens: np.ndarray, segment_ids: np.ndarray
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per MoE layer (execution order): (scores [n, E] of the real tokens, bias [E])."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from sparse_lm.moe import router as router_lib  # pylint: disable=g-import-not-at-top
  out: list = []
  orig = router_lib.route

  def wrapped(scores, bias, *a, **kw):
    jax.debug.callback(lambda s, b: out.append((np.asarray(s), np.asarray(b))), scores, bias,
                       ordered=True)
    return orig(scores, bias, *a, **kw)

  router_lib.route = wrapped
  try:
    jax.block_until_ready(model.forward_hidden(jnp.asarray(tokens),
                                               segment_ids=jnp.asarray(segment_ids))[0])
    jax.effects_barrier()
  finally:
    router_lib.route = orig
  real = segment_ids.reshape(-1) != 0
  return [(s[real].astype(np.float64), b.astype(np.float64)) for s, b in out]


def np_route(s: np.ndarray, b: np.ndarray, k: int, cutoff: str
             ) -> tuple[np.ndarray, np.ndarray]:
  """(expert ids [n, k], alpha [n]): top-k of s + b; alpha the midpoint of the k-th and
  (k+1)-th largest z (cutoff "midpoint") or the (k+1)-th (ARCHITECTURE §6 step 2)."""
  z = s + b[None]
  order = np.argsort(-z, axis=1, kind="stable")[:, :k + 1]
  zs = np.take_along_axis(z, order, 1)
  alpha = 0.5 * (zs[:, k - 1] + zs[:, k]) if cutoff == "midpoint" else zs[:, k]
  return order[:, :k], alpha


def max_mean(ids: np.ndarray, num_experts: int) -> float:
  load = np.bincount(ids.reshape(-1), minlength=num_experts)
  return float(load.max() / load.mean())


def qb_bias(s: np.ndarray, b: np.ndarray, k: int, cutoff: str, bins, iters: int = 1
            ) -> np.ndarray:
  """`iters` QB updates from the batch's scores, starting at b: the code's histogram with
  `bins` bins over its range (`sparse_lm.moe.balancing`), or the exact (k/E)-quantile of r
  (bins "exact")."""
  for _ in range(iters - 1):
    b = qb_bias(s, b, k, cutoff, bins)
  num_experts = s.shape[1]
  _, alpha = np_route(s, b, k, cutoff)
  r = alpha[:, None] - s
  if bins == "exact":
    b_hat = np.quantile(r, k / num_experts, axis=0)
    return b_hat - b_hat.mean()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from sparse_lm.moe import balancing  # pylint: disable=g-import-not-at-top
  lo, hi = balancing.histogram_range(jnp.asarray(b, jnp.float32))
  hist = balancing.required_bias_histogram(jnp.asarray(r, jnp.float32),
                                           jnp.ones((len(r),), jnp.float32), lo, hi, int(bins))
  return np.asarray(balancing.quantile_bias_update(hist, lo, hi, k, num_experts), np.float64)


def layer_probe(s: np.ndarray, b: np.ndarray, s_next: np.ndarray, k: int, cutoff: str,
                bins_list, rng, s_pool: np.ndarray | None = None) -> dict:
  """The numbers of the module docstring for one layer and one batch pair."""
  num_experts = s.shape[1]
  _, alpha = np_route(s, b, k, cutoff)
  r = alpha[:, None] - s
  out = {"score_std": float(np.median(s.std(0))),
         "r_width_5_7.5pct": float(np.median(np.quantile(r, 0.075, 0) - np.quantile(r, 0.05, 0))),
         "bin_width": {str(n): float((b.max() - b.min() + 2) / n) for n in bins_list
                       if n != "exact"},
         "trained": max_mean(np_route(s, b, k, cutoff)[0], num_experts),
         "same": {}, "next": {}}
  for n in bins_list:
    nb = qb_bias(s, b, k, cutoff, n)
    out["same"][str(n)] = max_mean(np_route(s, nb, k, cutoff)[0], num_experts)
    out["next"][str(n)] = max_mean(np_route(s_next, nb, k, cutoff)[0], num_experts)
  nb = qb_bias(s, b, k, cutoff, "exact", iters=8)  # converged on batch t
  out["same"]["exact x8"] = max_mean(np_route(s, nb, k, cutoff)[0], num_experts)
  out["next"]["exact x8"] = max_mean(np_route(s_next, nb, k, cutoff)[0], num_experts)
  if s_pool is not None:  # converged on other batches pooled (none of them batch t)
    nb = qb_bias(s_pool, b, k, cutoff, "exact", iters=8)
    out["pooled"] = max_mean(np_route(s, nb, k, cutoff)[0], num_experts)
  draws = rng.multinomial(len(s) * k, np.full(num_experts, 1 / num_experts), size=200)
  out["uniform"] = float((draws.max(1) / draws.mean(1)).mean())
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("run_dir")
  p.add_argument("--step", type=int, default=None, help="checkpoint (default: the newest)")
  p.add_argument("--batches", type=int, default=3)
  p.add_argument("--bins", default="256,1000,4096,exact")
  p.add_argument("--skip", type=int, default=0, help="training batches to skip first")
  p.add_argument("--out", default=None, help="write the numbers as JSON here")
  p.add_argument("--set", nargs="*", default=(), help="stage overrides of the data/batch")
  a = p.parse_args(argv)
  if a.batches < 1:
    p.error(f"--batches {a.batches}: give at least 1 (batches to probe)")
  bins_items = a.bins.split(",")
  if any(x != "exact" and not (x.isdigit() and int(x) > 0) for x in bins_items):
    p.error(f"--bins {a.bins}: give positive bin counts or 'exact', comma-separated")
  from experiments.ablations import BY_NAME, probe, run  # pylint: disable=g-import-not-at-top
  from experiments.base import apply_overrides  # pylint: disable=g-import-not-at-top
  from sparse_lm import data as data_lib  # pylint: disable=g-import-not-at-top
  saved_steps = probe.checkpoint_steps(pathlib.Path(a.run_dir))
  if not saved_steps:
    p.error(f"run_dir {a.run_dir}: no checkpoint there; give one seed's run directory of an "
            "ablation run (RESULTS/runs/<key>/seed<N>)")
  if a.step is not None and a.step not in saved_steps:
    p.error(f"--step {a.step}: {a.run_dir} has checkpoints at steps {saved_steps}")
  step = saved_steps[-1] if a.step is None else a.step
  model, tokenizer, saved = probe.load_at(pathlib.Path(a.run_dir), step)
  mc = saved.model_config()
  k, cutoff = mc.experts_per_token, mc.qb_cutoff
  abl = BY_NAME["balancing"]
  stage = run.stage_for(abl, "tiny", abl.variants[0], 0)  # the ablation's data and batch
  stage = apply_overrides(stage, tuple(a.set))
  it = data_lib.make_train_iterator(stage.data, tokenizer, seq_len=stage.seq_len,
                                    batch_size=stage.global_batch)
  for _ in range(a.skip):
    next(it)
  bins_list = [x if x == "exact" else int(x) for x in bins_items]
  caps = []
  for _ in range(a.batches + 1):
    batch = next(it)
    caps.append(capture_routing(model, batch["tokens"], batch["segment_ids"]))
  rng = np.random.default_rng(0)
  pool = lambda t, l: np.concatenate([c[l][0] for u, c in enumerate(caps) if u != t])
  res = [[layer_probe(caps[t][l][0], caps[t][l][1], caps[t + 1][l][0], k, cutoff, bins_list,
                      rng, pool(t, l)) for l in range(len(caps[t]))] for t in range(a.batches)]
  worst = lambda f: float(np.mean([max(f(x) for x in per_layer) for per_layer in res]))
  summary = {"run_dir": a.run_dir, "step": step, "cutoff": cutoff, "k": k,
             "experts": int(caps[0][0][0].shape[1]), "tokens": int(caps[0][0][0].shape[0]),
             "score_std_median": worst(lambda x: x["score_std"]),
             "r_width_5_7.5pct": worst(lambda x: x["r_width_5_7.5pct"]),
             "bin_width": res[0][0]["bin_width"],
             "trained": worst(lambda x: x["trained"]), "uniform": worst(lambda x: x["uniform"]),
             **{key: {n: worst(lambda x, n=n, key=key: x[key][n]) for n in res[0][0][key]}
                for key in ("same", "next")},
             "pooled": worst(lambda x: x["pooled"]),
             "per_layer": res}
  short = {k2: v for k2, v in summary.items() if k2 != "per_layer"}
  print(json.dumps(short, indent=1))
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps(summary))
  return summary


if __name__ == "__main__":
  main()
