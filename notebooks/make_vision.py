"""Writes notebooks/vision.ipynb (kept as code so the notebook stays reviewable).

  python notebooks/make_vision.py
"""

from nbformat.v4 import new_code_cell, new_markdown_cell

from nbwrite import COLAB, FIND_CHECKOUT, GET_CODE, write_notebook

cells = [
    new_markdown_cell(
        "# sparse_lm vision: captioning from scratch\n\n"
        "Trains the `tiny` model with a tiny native-resolution ViT on an image-caption mix "
        "(scikit-learn's handwritten digits and words rendered with matplotlib's DejaVu fonts, "
        "packed with standard-library text; nothing is downloaded), then shows held-out "
        "images with the captions the model generates. The same run as "
        "`python -m experiments.vision_demo --preset=tiny`.\n\n" + COLAB),
    new_code_cell(
        "import os, pathlib, subprocess, sys\n"
        + FIND_CHECKOUT + GET_CODE +
        "os.environ.setdefault('JAX_PLATFORMS', 'cpu')\n"
        "import dataclasses, tempfile\n"
        "import numpy as np\n"
        "from experiments import vision_demo\n"
        "from sparse_lm.data import DataConfig, make_train_iterator, load_or_train_tokenizer\n"
        "demo = vision_demo.PRESETS['tiny']\n"
        "STEPS = int(os.environ.get('VISION_STEPS', demo.steps))\n"
        "demo = dataclasses.replace(demo, steps=STEPS,\n"
        "                           eval_examples=int(os.environ.get('VISION_EVAL', '200')))\n"
        "workdir = tempfile.mkdtemp(prefix='sparse_lm_vision_')\n"
        "print(demo)"),
    new_markdown_cell(
        "## One packed row\nSeveral images of different native sizes and their captions share "
        "a row: each image is a span of `<image>` tokens (one per 28x28 px cell), its patches "
        "sit in the row's patch slots with the same segment id, and no loss is taken on image "
        "positions."),
    new_code_cell(
        "import matplotlib\n"
        "import matplotlib.pyplot as plt\n"
        "from sparse_lm.data import images as image_data\n"
        "tok = load_or_train_tokenizer(DataConfig(), workdir, 512)\n"
        "cfg = DataConfig(images=demo.images, image_ratio=1.0, eval_fraction=0.1, prefetch=0,\n"
        "                 image_patches_per_row=demo.patches_per_row)\n"
        "row = next(make_train_iterator(cfg, tok, seq_len=demo.seq_len, batch_size=1))\n"
        "seg, iseg = row['segment_ids'][0], row['image_segment_ids'][0]\n"
        "ids = [s for s in np.unique(iseg) if s > 0]\n"
        "fig, axes = plt.subplots(1, len(ids), figsize=(2 * len(ids), 2))\n"
        "for ax, s in zip(np.atleast_1d(axes), ids):\n"
        "  img = image_data.patches_to_image(row['image_patches'][0][iseg == s],\n"
        "                                    row['image_coords'][0][iseg == s], 14)\n"
        "  text = tok.decode([t for t, g in zip(row['tokens'][0], seg) if g == s and t > 3])\n"
        "  ax.imshow(img); ax.set_title(repr(text)); ax.axis('off')\n"
        "fig.tight_layout()\n"
        "print('loss mask:', row['loss_mask'][0].astype(int))"),
    new_markdown_cell("## Train"),
    new_code_cell(
        "graphdef, state, tok, mcfg, seconds = vision_demo.train(demo, workdir)\n"
        "print(f'trained in {seconds:.0f} s')"),
    new_markdown_cell("## Held-out captions\nExact match of the greedy caption (all caption "
                      "tokens and the end token)."),
    new_code_cell(
        "from sparse_lm.data import image_sources\n"
        "acc = {}\n"
        "for name in ('digits', 'words'):\n"
        "  ex = vision_demo.heldout(name, demo.eval_examples, demo.seed)\n"
        "  acc[name], caps = vision_demo.evaluate(graphdef, state, ex, tok, demo,\n"
        "                                         mcfg.vision_patch_size)\n"
        "  chance = 0.1 if name == 'digits' else 1 / len(image_sources.word_list())\n"
        "  print(f'held-out {name}: accuracy {acc[name]:.1%} (chance {chance:.1%})')\n"
        "  fig, axes = plt.subplots(1, 6, figsize=(12, 2))\n"
        "  for ax, (img, ref), got in zip(axes, ex, caps):\n"
        "    ax.imshow(img); ax.axis('off')\n"
        "    ax.set_title(f'{got!r}', color='green' if got == ref else 'red')\n"
        "  fig.tight_layout()"),
]

write_notebook(cells, "vision.ipynb")
