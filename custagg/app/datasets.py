"""Image classification data for the main job (application code: the library
never imports it): MNIST when it is on disk, else
scikit-learn's bundled handwritten digits.

Nothing is downloaded unless asked for (`download=True`). Where the data comes
from is always stated in `Dataset.source`, so a run never silently trains on
something other than what the user expects.

Search order of `load_dataset(name="auto")`:

1. `data_dir`, when given: the four MNIST IDX files (`train-images-idx3-ubyte`,
   `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
   `t10k-labels-idx1-ubyte`, each optionally `.gz`) or an `mnist.npz` in the
   Keras layout (`x_train`, `y_train`, `x_test`, `y_test`). A `data_dir`
   without MNIST in it is an error, not a reason to fall back.
2. Keras's cache: `$KERAS_HOME/datasets/mnist.npz`, `~/.keras/datasets/mnist.npz`
   (and `/tmp/.keras/...`, where Keras writes when home is read-only).
3. `sklearn.datasets.load_digits()`: 1,797 8x8 images, split into train and
   test with a seeded, stratified permutation.

Images are float32 in [0, 1], flattened to `[N, D]` (`Dataset.image_shape`
gives `(H, W, C)` to reshape them for a convolution); labels are int64 `[N]`.

Example:

    from custagg.app import datasets
    data = datasets.load_dataset()
    print(data.source)
    for xb, yb in datasets.minibatches(data.x_train, data.y_train,
                                       batch_size=64, seed=0):
        ...
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import shutil
import struct
import tempfile
import zipfile
import zlib

import numpy as np

__all__ = [
    "DataFormatError",
    "DownloadError",
    "MnistNotFoundError",
    "Dataset",
    "load_dataset",
    "load_mnist",
    "load_digits",
    "find_mnist",
    "mnist_file_names",
    "read_idx",
    "minibatches",
    "MNIST_URL",
]

MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
# Keras's published checksum of the file at MNIST_URL.
MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"

# (split, kind) -> base names of the IDX files. Both the "-idx" spelling of
# yann.lecun.com and the ".idx" spelling of some mirrors are accepted.
_IDX_NAMES = {
    ("train", "images"): ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    ("train", "labels"): ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    ("test", "images"): ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    ("test", "labels"): ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}

# IDX type code -> (numpy big-endian dtype, name).
_IDX_TYPES = {
    0x08: (">u1", "unsigned byte"),
    0x09: (">i1", "signed byte"),
    0x0B: (">i2", "short"),
    0x0C: (">i4", "int"),
    0x0D: (">f4", "float"),
    0x0E: (">f8", "double"),
}

_GZIP_MAGIC = b"\x1f\x8b"


class DataFormatError(ValueError):
    """A data file is missing pieces, truncated, or not what its name says."""


class DownloadError(RuntimeError):
    """`download=True` and the download failed (e.g. no internet access)."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A train/test split of flattened images.

    Attributes:
      name: "mnist" or "digits".
      source: one line saying which data set is in use and where it came from.
      x_train: float32 `[N_train, D]`, values in [0, 1].
      y_train: int64 `[N_train]`, values in `[0, num_classes)`.
      x_test: float32 `[N_test, D]`.
      y_test: int64 `[N_test]`.
      image_shape: `(H, W, C)` with `H * W * C == D`.
      num_classes: number of classes (10 for both data sets).
    """

    name: str
    source: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    image_shape: tuple
    num_classes: int

    @property
    def num_features(self):
        """D, the length of one flattened image."""
        return int(self.x_train.shape[1])

    def images(self, split="train"):
        """The images of `split` as `[N, H, W, C]` (a view, not a copy)."""
        x = {"train": self.x_train, "test": self.x_test}.get(split)
        if x is None:
            raise ValueError("Dataset.images: split must be 'train' or 'test'; "
                             "got %r." % (split,))
        return x.reshape((-1,) + tuple(self.image_shape))

    def subset(self, num_train=None, num_test=None):
        """The first `num_train` / `num_test` examples (None keeps all)."""
        return dataclasses.replace(
            self,
            x_train=self.x_train[:num_train], y_train=self.y_train[:num_train],
            x_test=self.x_test[:num_test], y_test=self.y_test[:num_test],
            source=self.source if num_train is None and num_test is None else
            "%s [subset: %d train / %d test]" % (
                self.source, len(self.x_train[:num_train]),
                len(self.x_test[:num_test])))

    def describe(self):
        """`source` plus sizes, e.g. for the first line a program prints."""
        return "%s: %d train / %d test images of %s, %d classes" % (
            self.source, len(self.x_train), len(self.x_test),
            "x".join(str(d) for d in self.image_shape), self.num_classes)


# --------------------------------------------------------------------------
# IDX files.


def _open_maybe_gzip(path):
    """Reads a whole file, un-gzipping it when it starts with the gzip magic."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] != _GZIP_MAGIC:
        if path.endswith(".gz"):
            raise DataFormatError(
                "%s: the name ends in .gz but the file is not gzip data (it "
                "does not start with bytes 1f 8b)." % path)
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataFormatError(
            "%s: gzip data is corrupted or truncated (%s). Download the file "
            "again." % (path, e)) from e


def read_idx(path, expected_ndim=None):
    """Reads an IDX file (the format of the MNIST distribution), raw or gzipped.

    The header is two zero bytes, a type code (0x08 = unsigned byte), the
    number of dimensions, then each dimension as a big-endian int32; the data
    follows in C order.

    Args:
      path: file path.
      expected_ndim: when given, the number of dimensions the file must have
        (3 for images, 1 for labels).

    Returns:
      A numpy array of the stored dtype (native byte order).

    Raises:
      DataFormatError: bad magic number, wrong number of dimensions, or a data
        section that is shorter or longer than the header says. The message
        names the file and what was expected.
    """
    data = _open_maybe_gzip(path)
    if len(data) < 4:
        raise DataFormatError(
            "%s: too short for an IDX file (%d bytes; the header alone is at "
            "least 4 bytes)." % (path, len(data)))
    zero, type_code, ndim = struct.unpack(">HBB", data[:4])
    magic = struct.unpack(">I", data[:4])[0]
    if zero != 0 or type_code not in _IDX_TYPES:
        raise DataFormatError(
            "%s: bad IDX magic number 0x%08X; expected 0x000008%02X (unsigned "
            "bytes, %s dimensions): two zero bytes, a type code in {%s}, then "
            "the number of dimensions. Is this an MNIST IDX file?" % (
                path, magic, expected_ndim or 0,
                expected_ndim if expected_ndim is not None else "n",
                ", ".join("0x%02X" % c for c in sorted(_IDX_TYPES))))
    if expected_ndim is not None and ndim != expected_ndim:
        raise DataFormatError(
            "%s: IDX magic number 0x%08X says %d dimension(s); expected %d "
            "(magic 0x000008%02X)." % (path, magic, ndim, expected_ndim,
                                      expected_ndim))
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataFormatError(
            "%s: truncated IDX header: %d dimension sizes need %d bytes, the "
            "file has %d." % (path, ndim, header_len, len(data)))
    dims = struct.unpack(">%dI" % ndim, data[4:header_len])
    dtype, type_name = _IDX_TYPES[type_code]
    itemsize = np.dtype(dtype).itemsize
    expected = int(np.prod(dims, dtype=np.int64)) * itemsize
    got = len(data) - header_len
    if got != expected:
        raise DataFormatError(
            "%s: %s IDX data: the header says shape %s of %s (%d bytes), "
            "but %d bytes follow the header." % (
                path, "truncated" if got < expected else "oversized",
                tuple(dims), type_name, expected, got))
    arr = np.frombuffer(data, dtype=dtype, offset=header_len)
    return arr.reshape(dims).astype(np.dtype(dtype).newbyteorder("="))


def _find_idx_file(data_dir, split, kind):
    for base in _IDX_NAMES[(split, kind)]:
        for name in (base, base + ".gz"):
            path = os.path.join(data_dir, name)
            if os.path.isfile(path):
                return path
    return None


def _idx_paths(data_dir):
    """The four IDX paths, None when none is there; raises when only some are."""
    paths = {key: _find_idx_file(data_dir, *key) for key in _IDX_NAMES}
    found = [p for p in paths.values() if p]
    if not found:
        return None
    missing = [names[0] + "[.gz]" for key, names in _IDX_NAMES.items()
               if paths[key] is None]
    if missing:
        raise DataFormatError(
            "%s holds some MNIST IDX files but not %s. All four are needed: %s."
            % (data_dir, ", ".join(missing),
               ", ".join(n[0] for n in _IDX_NAMES.values())))
    return paths


def _check_pair(images, labels, images_path, labels_path):
    if images.shape[0] != labels.shape[0]:
        raise DataFormatError(
            "%s holds %d images but %s holds %d labels; they must match." % (
                images_path, images.shape[0], labels_path, labels.shape[0]))


def _load_idx_dir(paths):
    arrays = {}
    for (split, kind), path in paths.items():
        arrays[(split, kind)] = read_idx(path, 3 if kind == "images" else 1)
    for split in ("train", "test"):
        _check_pair(arrays[(split, "images")], arrays[(split, "labels")],
                    paths[(split, "images")], paths[(split, "labels")])
    return (arrays[("train", "images")], arrays[("train", "labels")],
            arrays[("test", "images")], arrays[("test", "labels")])


# --------------------------------------------------------------------------
# mnist.npz (Keras layout).

_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


_ZIP_MAGIC = b"PK\x03\x04"


def _not_valid_npz(path, why):
    return DataFormatError(
        "%s is not a valid MNIST npz: %s. Expected a zip of .npy arrays %s, "
        "as keras.datasets.mnist stores it; download it again (the file may "
        "be truncated)." % (path, why, ", ".join(_NPZ_KEYS)))


def _load_npz(path):
    with open(path, "rb") as f:
        head = f.read(4)
    if head != _ZIP_MAGIC:
        raise _not_valid_npz(path, "it is not a zip archive (it starts with "
                             "bytes %s, not 50 4b 03 04)" % (head.hex(" ")
                                                             or "nothing"))
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in _NPZ_KEYS if k not in f.files]
            if missing:
                raise DataFormatError(
                    "%s: missing array(s) %s; an mnist.npz in the Keras layout "
                    "holds %s (found: %s)." % (
                        path, ", ".join(missing), ", ".join(_NPZ_KEYS),
                        ", ".join(f.files) or "none"))
            arrays = [f[k] for k in _NPZ_KEYS]
    except DataFormatError:
        raise
    except ValueError as e:
        # allow_pickle=False refuses object arrays; numpy's message then
        # suggests loading "unsafely", which is never the fix for MNIST.
        why = ("it holds object (pickled) arrays, which an MNIST npz never "
               "does" if "pickle" in str(e) else "unreadable arrays (%s)" % e)
        raise _not_valid_npz(path, why) from e
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise _not_valid_npz(path, "a broken zip archive (%s)" % e) from e
    x_train, y_train, x_test, y_test = arrays
    for key, x in (("x_train", x_train), ("x_test", x_test)):
        if x.ndim not in (3, 4):
            raise DataFormatError(
                "%s: %s has shape %s; expected images [N, H, W] or "
                "[N, H, W, C]." % (path, key, x.shape))
    for key, y in (("y_train", y_train), ("y_test", y_test)):
        if y.ndim != 1:
            raise DataFormatError(
                "%s: %s has shape %s; expected labels [N]." % (path, key,
                                                              y.shape))
    _check_pair(x_train, y_train, path + ":x_train", path + ":y_train")
    _check_pair(x_test, y_test, path + ":x_test", path + ":y_test")
    return x_train, y_train, x_test, y_test


# --------------------------------------------------------------------------
# Turning raw arrays into a Dataset.


def _to_unit_float(x, source):
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255.0)
    x = x.astype(np.float32)
    hi = float(x.max()) if x.size else 0.0
    lo = float(x.min()) if x.size else 0.0
    if lo < 0:
        raise DataFormatError(
            "%s: images have negative values (min %g); expected pixel "
            "intensities in [0, 255] or [0, 1]." % (source, lo))
    return x / np.float32(255.0) if hi > 1.0 else x


def _make_dataset(name, source, x_train, y_train, x_test, y_test,
                  num_classes=None):
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataFormatError(
            "%s: train images are %s but test images are %s." % (
                source, x_train.shape[1:], x_test.shape[1:]))
    image_shape = tuple(int(d) for d in x_train.shape[1:])
    if len(image_shape) == 2:
        image_shape += (1,)
    d = int(np.prod(image_shape))
    y_train = y_train.astype(np.int64)
    y_test = y_test.astype(np.int64)
    if num_classes is None:
        num_classes = int(max(y_train.max(initial=-1),
                              y_test.max(initial=-1)) + 1)
    for key, y in (("train", y_train), ("test", y_test)):
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            raise DataFormatError(
                "%s: %s labels range over [%d, %d]; expected [0, %d)." % (
                    source, key, y.min(), y.max(), num_classes))
    return Dataset(
        name=name, source=source,
        x_train=_to_unit_float(x_train, source).reshape(-1, d),
        y_train=y_train,
        x_test=_to_unit_float(x_test, source).reshape(-1, d),
        y_test=y_test,
        image_shape=image_shape, num_classes=num_classes)


# --------------------------------------------------------------------------
# Where MNIST may be.


def keras_cache_paths():
    """Places Keras's `mnist.load_data()` leaves `mnist.npz`, in search order."""
    homes = []
    if os.environ.get("KERAS_HOME"):
        homes.append(os.environ["KERAS_HOME"])
    homes.append(os.path.join(os.path.expanduser("~"), ".keras"))
    homes.append(os.path.join(tempfile.gettempdir(), ".keras"))
    seen, paths = set(), []
    for home in homes:
        p = os.path.join(home, "datasets", "mnist.npz")
        if p not in seen:
            seen.add(p)
            paths.append(p)
    return paths


def find_mnist(data_dir=None, use_keras_cache=True):
    """Locates MNIST on disk without reading it.

    Args:
      data_dir: a directory with the IDX files or `mnist.npz`, or a path to an
        `.npz` file itself. None searches only Keras's cache.
      use_keras_cache: also look in Keras's cache when `data_dir` is None.

    Returns:
      `("idx", {(split, kind): path})`, `("npz", path)` or `None`.

    Raises:
      DataFormatError: `data_dir` holds only some of the four IDX files.
    """
    if data_dir is not None:
        data_dir = os.path.expanduser(data_dir)
        if os.path.isfile(data_dir):
            return ("npz", data_dir)
        if os.path.isdir(data_dir):
            paths = _idx_paths(data_dir)
            if paths:
                return ("idx", paths)
            npz = os.path.join(data_dir, "mnist.npz")
            if os.path.isfile(npz):
                return ("npz", npz)
        return None
    if use_keras_cache:
        for p in keras_cache_paths():
            if os.path.isfile(p):
                return ("npz", p)
    return None


def mnist_file_names():
    """The file names `find_mnist` looks for in a directory, in order."""
    names = []
    for base in _IDX_NAMES.values():
        names.append(base[0] + "[.gz]")
    return names + ["mnist.npz"]


class MnistNotFoundError(FileNotFoundError):
    """MNIST is not where it was looked for.

    Attributes:
      where: the directory (or a description of Keras's cache) searched.
      dir_exists: False when `where` is a directory that does not exist.
      looked_for: the file names looked for (`mnist_file_names()`).
    """

    def __init__(self, where, dir_exists=True):
        self.where = where
        self.dir_exists = dir_exists
        self.looked_for = mnist_file_names()
        if not dir_exists:
            text = ("data_dir %s does not exist. Pass a directory that holds "
                    "MNIST, or leave data_dir unset to use scikit-learn's "
                    "bundled 8x8 digits." % where)
        else:
            text = (
                "No MNIST found in %s. Expected either the four IDX files (%s,"
                " each optionally gzipped) or mnist.npz with arrays %s. Put "
                "them there, pass download=True (needs internet access), or "
                "leave data_dir unset to use scikit-learn's bundled 8x8 "
                "digits." % (where, ", ".join(
                    n[0] for n in _IDX_NAMES.values()), ", ".join(_NPZ_KEYS)))
        super().__init__(text)


def load_mnist(data_dir=None, download=False):
    """Loads MNIST from `data_dir` or Keras's cache; never falls back.

    Args:
      data_dir: directory with the IDX files or `mnist.npz` (or the `.npz`
        path). None looks in Keras's cache (`~/.keras/datasets/mnist.npz`).
      download: when MNIST is not found, fetch `mnist.npz` from `MNIST_URL`
        into `data_dir` (or Keras's cache). Off by default: nothing is
        downloaded unless asked for.

    Returns:
      A `Dataset` named "mnist" (60,000 / 10,000 images of 28x28x1 for the
      real files).

    Raises:
      MnistNotFoundError: (a FileNotFoundError) MNIST is not there (and
        `download` is False); `.dir_exists` and `.looked_for` say more.
      DataFormatError: a file is corrupted, truncated or of the wrong layout.
      DownloadError: `download=True` and the download failed (e.g. offline).
    """
    found = find_mnist(data_dir)
    if found is None and download:
        target_dir = (os.path.expanduser(data_dir) if data_dir is not None
                      else os.path.dirname(keras_cache_paths()[0]))
        found = ("npz", download_mnist(target_dir))
    if found is None:
        if data_dir is not None:
            raise MnistNotFoundError(data_dir, os.path.exists(
                os.path.expanduser(data_dir)))
        raise MnistNotFoundError(
            "Keras's cache (%s)" % ", ".join(keras_cache_paths()))
    kind, where = found
    if kind == "idx":
        arrays = _load_idx_dir(where)
        source = "MNIST (IDX files in %s)" % os.path.dirname(
            where[("train", "images")])
    else:
        arrays = _load_npz(where)
        source = "MNIST (%s)" % where
    return _make_dataset("mnist", source, *arrays, num_classes=10)


def download_mnist(target_dir, url=MNIST_URL, timeout=30):
    """Downloads `mnist.npz` into `target_dir` and checks its SHA-256.

    Returns:
      The path of the downloaded file.

    Raises:
      DownloadError: the download failed (no network, HTTP error, wrong
        checksum); the message says how to provide the data by hand.
    """
    import urllib.request  # pylint: disable=g-import-not-at-top
    dest = os.path.join(target_dir, "mnist.npz")
    tmp = dest + ".part"
    try:
        os.makedirs(target_dir, exist_ok=True)
        with urllib.request.urlopen(url, timeout=timeout) as resp, \
                open(tmp, "wb") as out:
            shutil.copyfileobj(resp, out)
        with open(tmp, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != MNIST_SHA256:
            raise RuntimeError("SHA-256 %s does not match the expected %s"
                               % (digest, MNIST_SHA256))
        os.replace(tmp, dest)
    except Exception as e:  # pylint: disable=broad-except
        if os.path.exists(tmp):
            os.remove(tmp)
        raise DownloadError(
            "Could not download MNIST from %s into %s: %s: %s. Without "
            "internet access, copy mnist.npz (or the four IDX files) into a "
            "directory and pass it as data_dir, or use the bundled digits "
            "(load_dataset() without data_dir)." % (
                url, target_dir, type(e).__name__, e)) from e
    return dest


def load_digits(test_fraction=0.2, seed=0):
    """scikit-learn's 1,797 handwritten digits (8x8, 16 grey levels).

    The split is stratified and fixed by `seed`: each class is permuted with
    `np.random.RandomState(seed)` (whose stream NumPy keeps stable across
    versions) and its last `round(test_fraction * n_class)` examples go to the
    test set. Both sets are then shuffled with the same generator.

    Returns:
      A `Dataset` named "digits" with image_shape (8, 8, 1) and pixel values
      divided by 16.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError("load_digits: test_fraction must be in (0, 1); got %r."
                         % (test_fraction,))
    from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top
    bunch = sk_datasets.load_digits()
    images = bunch.images.astype(np.float32) / np.float32(16.0)
    labels = bunch.target.astype(np.int64)
    rng = np.random.RandomState(seed)
    train_idx, test_idx = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(test_fraction * len(idx)))
        test_idx.append(idx[len(idx) - n_test:])
        train_idx.append(idx[:len(idx) - n_test])
    train_idx = rng.permutation(np.concatenate(train_idx))
    test_idx = rng.permutation(np.concatenate(test_idx))
    source = ("scikit-learn digits (8x8 handwritten digits, 1,797 images; "
              "used because no MNIST was found; seeded split, seed=%d)" % seed)
    return _make_dataset("digits", source, images[train_idx],
                         labels[train_idx], images[test_idx], labels[test_idx],
                         num_classes=10)


def load_dataset(name="auto", data_dir=None, download=False, seed=0):
    """The main job's data: MNIST when available, else the bundled digits.

    Args:
      name: "auto" (MNIST from `data_dir` or Keras's cache, else digits),
        "mnist" (MNIST or an error) or "digits".
      data_dir: directory with MNIST. When given, MNIST must be there (an
        explicit directory without it is an error, not a silent fallback).
      download: see `load_mnist`.
      seed: the digits' train/test split.

    Returns:
      A `Dataset`; print `dataset.source` to say which one is in use.
    """
    if name == "digits":
        if data_dir is not None:
            raise ValueError("load_dataset: data_dir is only used for MNIST; "
                             "got name='digits' with data_dir=%r." % data_dir)
        return load_digits(seed=seed)
    if name == "mnist":
        return load_mnist(data_dir, download=download)
    if name != "auto":
        raise ValueError("load_dataset: name must be 'auto', 'mnist' or "
                         "'digits'; got %r." % (name,))
    if data_dir is not None or download:
        return load_mnist(data_dir, download=download)
    if find_mnist(None) is not None:
        return load_mnist(None)
    return load_digits(seed=seed)


# --------------------------------------------------------------------------
# Batching.


def minibatches(x, y, batch_size, seed=0, epoch=0, shuffle=True,
                drop_remainder=True):
    """Yields `(x_batch, y_batch)` over one epoch.

    Each (seed, epoch) pair gives its own fixed order, so a training loop that
    passes `epoch=e` sees a new shuffle every epoch and the same run twice.

    Args:
      x: `[N, ...]` array.
      y: `[N, ...]` array (same N).
      batch_size: examples per batch.
      seed: int seed of the shuffle.
      epoch: mixed into the seed.
      shuffle: False keeps the stored order.
      drop_remainder: drop the last batch when it is smaller than
        `batch_size` (the default: graphs with a static batch size, and
        `num_microbatches`, need every batch to be full).

    Yields:
      `(x[idx], y[idx])` with `len(idx) == batch_size` (or less for the last
      batch when `drop_remainder` is False).
    """
    n = len(x)
    if len(y) != n:
        raise ValueError("minibatches: x has %d examples but y has %d." % (
            n, len(y)))
    if isinstance(batch_size, bool) or not isinstance(
            batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError("minibatches: batch_size must be a positive int; "
                         "got %r." % (batch_size,))
    if drop_remainder and batch_size > n:
        raise ValueError(
            "minibatches: batch_size=%d is larger than the %d examples, so "
            "with drop_remainder=True there would be no batch at all."
            % (batch_size, n))
    order = (np.random.RandomState([int(seed) & 0xFFFFFFFF,
                                    int(epoch) & 0xFFFFFFFF]).permutation(n)
             if shuffle else np.arange(n))
    stop = n - n % batch_size if drop_remainder else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        yield x[idx], y[idx]
