"""Writes notebooks/ablations.ipynb (kept as code so the notebook stays reviewable).

  python notebooks/make_ablations.py

The notebook loads the recorded ablation runs (docs/ablations/results.json, written by
`python -m experiments.ablations.report`), prints each claim's table and verdict and shows the
plots. It trains nothing; rerun the report to refresh the numbers.
"""

from nbformat.v4 import new_code_cell, new_markdown_cell

from nbwrite import COLAB, FIND_CHECKOUT, GET_CODE, write_notebook

cells = [
    new_markdown_cell(
        "# Ablations of the seed's claims\n\n"
        "Loads the runs recorded by `python -m experiments.ablations.report --preset=tiny` "
        "(`docs/ablations/results.json`) and shows, per claim, the table (mean ± half-range "
        "over seeds), what the numbers say, and the curves. Claims without a record are listed "
        "as not run.\n\n" + COLAB),
    new_code_cell(
        "import json, os, pathlib, subprocess, sys\n"
        + FIND_CHECKOUT + GET_CODE +
        "import sparse_lm\n"
        "ROOT = pathlib.Path(sparse_lm.__file__).resolve().parent.parent  # the repository\n"
        "os.chdir(ROOT)\n"
        "store = ROOT / 'docs' / 'ablations' / 'results.json'\n"
        "results = json.loads(store.read_text()) if store.exists() else {}\n"
        "print('recorded:', sorted(k for k in results if not k.startswith('_')))"),
    new_code_cell(
        "from experiments.ablations import ABLATIONS\n"
        "from experiments.ablations.report import verdict\n"
        "from experiments.ablations.run import extra_tables, summarize\n"
        "for a in ABLATIONS:\n"
        "  print(f'== {a.name}: {a.claim}')\n"
        "  rec = results.get(a.name)\n"
        "  if rec is None:\n"
        "    print('   not run yet\\n')\n"
        "    continue\n"
        "  header, rows = summarize(rec)\n"
        "  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]\n"
        "  for r in [header] + rows:\n"
        "    print('   ' + '  '.join(str(x).ljust(w) for x, w in zip(r, widths)))\n"
        "  print('   ' + verdict(rec) + '\\n')\n"
        "  for title, head, body in extra_tables(rec):\n"
        "    print('   ' + title)\n"
        "    for r in [head] + body:\n"
        "      print('     ' + '  '.join(f'{x:>9}' for x in r))\n"
        "  print()"),
    new_code_cell(
        "import matplotlib\n"
        "import matplotlib.pyplot as plt\n"
        "from experiments.ablations.report import _mean_curve\n"
        "shown = 0\n"
        "for name, rec in results.items():\n"
        "  if name.startswith('_'):\n"
        "    continue\n"
        "  keys = ['loss'] + (['max_mean_load'] if name == 'balancing' else [])\n"
        "  fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 3.5), squeeze=False)\n"
        "  for ax, key in zip(axes[0], keys):\n"
        "    for label, v in rec['variants'].items():\n"
        "      xs, ys = _mean_curve(v['runs'], key)\n"
        "      ax.plot(xs, ys, label=label)\n"
        "    ax.set_xlabel('step'); ax.set_ylabel(key); ax.set_title(name); ax.legend(fontsize=8)\n"
        "    if key == 'max_mean_load':\n"
        "      ax.set_yscale('log'); ax.axhline(1.3, color='gray', linestyle=':')\n"
        "  fig.tight_layout(); plt.show(); shown += 1\n"
        "print('plotted', shown, 'ablation(s)')"),
    new_code_cell(
        "# The dense diagonal-tile exponent over training (gate ablation), as the report drew it\n"
        "from IPython.display import Image, display\n"
        "png = ROOT / 'docs' / 'ablations' / 'gate_exponent.png'\n"
        "if png.exists():\n"
        "  display(Image(filename=str(png)))\n"
        "print('gate exponent plot:', 'shown' if png.exists() else 'not recorded')"),
]

write_notebook(cells, "ablations.ipynb")
