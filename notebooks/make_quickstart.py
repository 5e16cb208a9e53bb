"""Writes notebooks/quickstart.ipynb (kept as code so the notebook stays reviewable).

  python notebooks/make_quickstart.py
"""

from nbformat.v4 import new_code_cell, new_markdown_cell

from nbwrite import COLAB, FIND_CHECKOUT, GET_CODE, write_notebook

cells = [
    new_markdown_cell(
        "# sparse_lm quickstart\n\n"
        "Builds the `tiny` preset of the hybrid KDA + Gated MLA model with Stable LatentMoE "
        "(Quantile Balancing) and Block AttnRes, trains it for a few hundred steps on the Python "
        "standard library's source (no download), plots the loss and samples text.\n\n"
        + COLAB),
    new_code_cell(
        "import os, pathlib, subprocess, sys\n"
        + FIND_CHECKOUT + GET_CODE +
        "os.environ.setdefault('JAX_PLATFORMS', 'cpu' if 'COLAB_TPU_ADDR' not in os.environ\n"
        "                      and not os.path.exists('/proc/driver/nvidia') else '')\n"
        "if not os.environ['JAX_PLATFORMS']:\n"
        "  del os.environ['JAX_PLATFORMS']\n"
        "import jax\n"
        "print('jax', jax.__version__, jax.devices())"),
    new_markdown_cell("## The model\n`count_params` works from abstract shapes: the 2.8T "
                      "`full` preset is counted without allocating it."),
    new_code_cell(
        "from sparse_lm.config import get_preset\n"
        "from sparse_lm.model.params import count_params\n"
        "size = lambda n: f'{n / 1e9:.3f}B' if n >= 1e9 else f'{n / 1e6:.2f}M'\n"
        "for name in ('tiny', 'small', 'full'):\n"
        "  c = count_params(get_preset(name))\n"
        "  print(f\"{name:>5}: {size(c['total']):>9} total, {size(c['active']):>9} active\")"),
    new_markdown_cell("## Train the tiny preset\nThe `stage_8k` experiment at the tiny preset "
                      "(its sequence length scaled down to 256 tokens)."),
    new_code_cell(
        "import dataclasses, tempfile\n"
        "from experiments import stage_8k\n"
        "from sparse_lm.train.loop import run\n"
        "STEPS = int(os.environ.get('QUICKSTART_STEPS', '300'))\n"
        "stage = dataclasses.replace(stage_8k.TINY, steps=STEPS, eval_every=max(STEPS // 3, 1),\n"
        "                            checkpoint_every=STEPS)\n"
        "workdir = tempfile.mkdtemp(prefix='sparse_lm_quickstart_')\n"
        "result = run(stage, workdir, progress=False)\n"
        "print('held-out loss by step:', {k: round(v, 3) for k, v in result.evals.items()})"),
    new_code_cell(
        "import matplotlib\n"
        "import matplotlib.pyplot as plt\n"
        "steps = sorted(result.losses)\n"
        "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
        "ax.plot(steps, [result.losses[s] for s in steps], label='train')\n"
        "ax.plot(sorted(result.evals), [result.evals[s] for s in sorted(result.evals)], 'o-',\n"
        "        label='held-out')\n"
        "ax.set_xlabel('step'); ax.set_ylabel('loss (nats/token)'); ax.legend()\n"
        "fig.tight_layout()\n"
        "fig.savefig(os.path.join(workdir, 'loss.png'))"),
    new_markdown_cell("## Sample"),
    new_code_cell(
        "print(repr(result.sample))\n"
        "first, last = result.evals[min(result.evals)], result.evals[max(result.evals)]\n"
        "print(f'held-out loss {first:.3f} -> {last:.3f} ({100 * (1 - last / first):.0f}% lower)')\n"
        "assert last < first"),
]

write_notebook(cells, "quickstart.ipynb", colab={"provenance": []})
