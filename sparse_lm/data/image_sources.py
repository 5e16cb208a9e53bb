"""Image-caption sources: real images from installed packages, and user data (no downloads).

A spec (`DataConfig.images`) is one source or several joined by `+` (their examples are
concatenated, e.g. `digits+words`):

  digits                scikit-learn's bundled handwritten digits (1,797 8x8 images, shown
                        at 3x = 24x24 px); caption: the digit, e.g. "7".
  words                 single words (Python keywords and builtins) rendered with the DejaVu
                        fonts matplotlib ships, in 3 faces x 2 sizes x jittered offsets;
                        caption: the word. A reading task.
  lines[:N]             N (default 3) lines of standard-library source text rendered as one
                        multi-line image (DejaVu Sans Mono); caption: the text. Scales to long
                        images: N = 40 is a page.
  samples               scikit-image's bundled sample images (caption: the first line of their
                        documentation) and matplotlib's sample photos.
  imagefolder:PATH      every image under PATH (recursive); captions from a sidecar
                        `metadata.jsonl` / `captions.jsonl` ({"file_name": ..., "text": ...})
                        when present, else from the file name ("red_car.jpg" -> "red car").
  imagejsonl:PATH       jsonl lines {"image": path relative to the file, "caption" or "text"}.
  imagetar:PATH         a webdataset-style tar: members `KEY.<image ext>` with `KEY.txt`
                        (or `KEY.json` with "caption"/"text") sharing the key.

Each source is a random-access sequence: `len(src)`, `src.doc_ids[i]`, and
`src.load(i) -> (uint8 [h, w, 3], caption) | None` (None: skipped, counted in `src.stats`).
The held-out split is chosen by a hash of the document id (`sources.is_eval_document`), as
for text. A caption file that names a missing image is reported (a warning with its path,
counted as `missing_file`) and the entry dropped.
"""

from __future__ import annotations

import builtins
import glob
import json
import keyword
import os
import tarfile
import threading
import warnings

import numpy as np

from sparse_lm.data import images, sources

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp")
BUILTIN = ("digits", "words", "lines", "samples")
SCHEMES = ("imagefolder", "imagejsonl", "imagetar")


class ImageSource:
  """Base: `doc_ids`, `load(i)`, `stats` (see the module docstring)."""

  def __init__(self, name: str, doc_ids: list[str]):
    self.name, self.doc_ids, self.stats = name, doc_ids, images.ImageStats()

  def __len__(self) -> int:
    return len(self.doc_ids)

  def load(self, index: int) -> tuple[np.ndarray, str] | None:
    raise NotImplementedError


class _Listed(ImageSource):
  """Items given as (doc_id, loader() -> (image | None, caption))."""

  def __init__(self, name, items):
    super().__init__(name, [d for d, _ in items])
    self._loaders = [f for _, f in items]

  def load(self, index):
    image, caption = self._loaders[index](self.stats)
    return None if image is None else (image, caption)


def _digits():
  from sklearn.datasets import load_digits

  d = load_digits()
  ims = np.repeat(np.repeat(d.images, 3, axis=1), 3, axis=2)  # [n, 24, 24]
  g = np.clip(np.round(ims * (255.0 / 16.0)), 0, 255).astype(np.uint8)
  return [(f"digits/{i}", lambda st, a=g[i], t=int(d.target[i]): (
      np.repeat(a[..., None], 3, -1), str(t))) for i in range(len(g))]


def font_path(name: str = "DejaVuSans.ttf") -> str:
  """Path of a DejaVu font that matplotlib ships."""
  import matplotlib
  return os.path.join(matplotlib.get_data_path(), "fonts", "ttf", name)


FACES = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf")


def render_text(text: str, *, face: str = "DejaVuSans.ttf", size: int = 14,
                offset: tuple[int, int] = (2, 2), pad: int = 2) -> np.ndarray:
  """Black text on white, uint8 [h, w, 3], just large enough for `text` (lines split on \\n)."""
  from PIL import Image, ImageDraw, ImageFont

  font = ImageFont.truetype(font_path(face), size)
  box = ImageDraw.Draw(Image.new("L", (1, 1))).multiline_textbbox((0, 0), text, font=font)
  w, h = box[2] + offset[1] + pad, box[3] + offset[0] + pad
  img = Image.new("L", (w, h), 255)
  ImageDraw.Draw(img).multiline_text((offset[1], offset[0]), text, fill=0, font=font)
  return np.repeat(np.asarray(img, np.uint8)[..., None], 3, -1)


def word_list() -> list[str]:
  """The `words` vocabulary: Python keywords and lower-case builtin names of 2-8 letters."""
  names = set(keyword.kwlist) | {n for n in dir(builtins) if n.islower() and n.isalpha()}
  return sorted(n for n in names if n.isalpha() and 2 <= len(n) <= 8)


def _words(variants: int = 24):
  words = word_list()
  out = []
  for v in range(variants):
    face, size = FACES[v % 3], (13, 15)[(v // 3) % 2]
    offset = (1 + v % 4, 1 + (v * 7) % 5)
    for w in words:
      out.append((f"words/{w}/{v}", lambda st, w=w, f=face, s=size, o=offset: (
          render_text(w, face=f, size=s, offset=o), w)))
  return out


def _lines(n: int):
  root, files = sources.stdlib_files()
  text_lines = []
  for rel in files[:100]:
    try:
      with open(os.path.join(root, rel), encoding="utf-8") as f:
        text_lines += [ln.rstrip() for ln in f if 0 < len(ln.strip()) <= 60 and ln.isascii()]
    except (OSError, UnicodeDecodeError):
      continue
  groups = [text_lines[i:i + n] for i in range(0, len(text_lines) - n + 1, n)]
  return [(f"lines{n}/{i}", lambda st, g=g: (render_text("\n".join(g), face=FACES[2], size=12),
                                              "\n".join(g))) for i, g in enumerate(groups)]


def _samples():
  import matplotlib
  items = []
  mpl = os.path.join(matplotlib.get_data_path(), "sample_data")
  for fname, caption in (("grace_hopper.jpg", "Grace Hopper in uniform"),
                         ("logo2.png", "the matplotlib logo"),
                         ("Minduka_Present_Blue_Pack.png", "a blue gift box")):
    path = os.path.join(mpl, fname)
    if os.path.exists(path):
      items.append((f"matplotlib/{fname}", lambda st, p=path, c=caption: (
          images.read_image(p, st), c)))
  try:
    import skimage.data as skd
  except ImportError:
    return items
  folder = os.path.dirname(skd.__file__)
  for fname in sorted(os.listdir(folder)):
    stem, ext = os.path.splitext(fname)
    fn = getattr(skd, stem, None)
    if ext.lower() not in IMAGE_EXTENSIONS or fn is None or not fn.__doc__:
      continue
    caption = fn.__doc__.strip().splitlines()[0].rstrip(".")
    items.append((f"skimage/{fname}", lambda st, p=os.path.join(folder, fname), c=caption: (
        images.read_image(p, st), c)))
  return items


def _caption_from_name(path: str) -> str:
  return os.path.splitext(os.path.basename(path))[0].replace("_", " ").replace("-", " ")


def _jsonl_items(jsonl: str, root: str, stats: images.ImageStats, key: str):
  items = []
  with open(jsonl, encoding="utf-8") as f:
    for n, line in enumerate(f):
      if not line.strip():
        continue
      rec = json.loads(line)
      rel, caption = rec.get(key) or rec.get("image") or rec.get("file_name"), \
          rec.get("caption", rec.get("text"))
      if rel is None or caption is None:
        raise ValueError(f"{jsonl}:{n + 1}: each line needs '{key}' and 'caption' (or 'text')")
      path = os.path.join(root, rel)
      if not os.path.exists(path):
        stats.add("missing_file", path)
        warnings.warn(f"{jsonl}:{n + 1} names an image that does not exist: {path} (skipped)",
                      stacklevel=3)
        continue
      items.append((os.path.relpath(path, root), lambda st, p=path, c=str(caption): (
          images.read_image(p, st), c)))
  return items


def _imagefolder(root: str, stats):
  if not os.path.isdir(root):
    raise FileNotFoundError(f"imagefolder:{root}: no such directory")
  for side in ("metadata.jsonl", "captions.jsonl"):
    if os.path.exists(os.path.join(root, side)):
      return _jsonl_items(os.path.join(root, side), root, stats, "file_name")
  files = sorted(p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True)
                 if p.lower().endswith(IMAGE_EXTENSIONS))
  return [(os.path.relpath(p, root), lambda st, p=p: (images.read_image(p, st),
                                                      _caption_from_name(p))) for p in files]


class _TarSource(ImageSource):
  """webdataset-style tar, indexed once (member offsets), read by offset."""

  def __init__(self, path: str):
    self._path, self._lock = path, threading.Lock()
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    with tarfile.open(path) as tf:
      for m in tf.getmembers():
        if m.isfile():
          key, ext = os.path.splitext(m.name)
          groups.setdefault(key, {})[ext.lower()] = m
    self._items = []
    for key in sorted(groups):
      g = groups[key]
      img = next((g[e] for e in IMAGE_EXTENSIONS if e in g), None)
      cap = g.get(".txt") or g.get(".caption") or g.get(".json")
      if img is not None and cap is not None:
        self._items.append((img, cap))
    super().__init__(f"imagetar:{path}", [m.name for m, _ in self._items])

  def load(self, index):
    img_m, cap_m = self._items[index]
    with self._lock, tarfile.open(self._path) as tf:
      data, cap = tf.extractfile(img_m).read(), tf.extractfile(cap_m).read().decode("utf-8")
    if cap_m.name.endswith(".json"):
      rec = json.loads(cap)
      cap = rec.get("caption", rec.get("text", ""))
    image = images.decode_image(data, f"{self._path}:{img_m.name}", self.stats)
    return None if image is None else (image, cap.strip())


def _open_one(spec: str) -> ImageSource:
  scheme, _, arg = spec.partition(":")
  if scheme == "digits":
    return _Listed(spec, _digits())
  if scheme == "words":
    return _Listed(spec, _words())
  if scheme == "lines":
    return _Listed(spec, _lines(int(arg or 3)))
  if scheme == "samples":
    return _Listed(spec, _samples())
  if scheme == "imagetar":
    return _TarSource(arg)
  stats = images.ImageStats()
  if scheme == "imagefolder":
    items = _imagefolder(arg, stats)
  elif scheme == "imagejsonl":
    items = _jsonl_items(arg, os.path.dirname(os.path.abspath(arg)), stats, "image")
  else:
    raise ValueError(f"image source {spec!r}: choose from {BUILTIN} or "
                     f"{', '.join(s + ':PATH' for s in SCHEMES)}")
  src = _Listed(spec, items)
  src.stats = stats
  return src


def check_spec(spec: str) -> None:
  """Raise ValueError for a malformed `DataConfig.images` spec (without opening anything)."""
  for part in spec.split("+"):
    scheme, _, arg = part.partition(":")
    if scheme in BUILTIN and (scheme == "lines" or not arg):
      if scheme == "lines" and arg and not arg.isdigit():
        raise ValueError(f"image source {part!r}: lines:N needs an integer N")
      continue
    if scheme in SCHEMES and arg:
      continue
    raise ValueError(f"image source {part!r}: choose from {BUILTIN} or "
                     f"{', '.join(s + ':PATH' for s in SCHEMES)}")


class _Split(ImageSource):
  """The train or eval documents of several sources, concatenated."""

  def __init__(self, parts: list[ImageSource], split: str, eval_fraction: float):
    self._index = [(s, i) for s in parts for i, d in enumerate(s.doc_ids)
                   if sources.is_eval_document(d, eval_fraction) == (split == "eval")]
    super().__init__("+".join(s.name for s in parts), [s.doc_ids[i] for s, i in self._index])
    self.parts = parts

  def load(self, index):
    src, i = self._index[index]
    return src.load(i)

  def summary(self) -> str:
    return "; ".join(f"{s.name}: {s.stats.summary()}" for s in self.parts if s.stats.summary())


def open_images(spec: str, *, split: str, eval_fraction: float) -> _Split:
  """The `split` ("train" / "eval") of the image sources in `spec` (module docstring).

  Raises:
    ValueError: unknown source or malformed spec; FileNotFoundError: a missing folder / file.
  """
  check_spec(spec)
  return _Split([_open_one(s) for s in spec.split("+")], split, eval_fraction)
