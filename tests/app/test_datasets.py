"""custagg.app.datasets: IDX / npz readers, errors on bad files, digits, batching.

Every MNIST file here is written by the test itself (small fake images), so
nothing is downloaded and the real MNIST is never needed.
"""

import gzip
import os
import struct

import numpy as np
import pytest

from custagg.app import datasets


# --------------------------------------------------------------------------
# Writing fake MNIST.


def idx_bytes(array, type_code=0x08):
    """IDX encoding of `array`: 0x0000, type code, ndim, big-endian dims, data."""
    array = np.asarray(array)
    header = struct.pack(">HBB", 0, type_code, array.ndim)
    header += struct.pack(">%dI" % array.ndim, *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def fake_mnist(seed=0, n_train=12, n_test=5, h=28, w=28):
    rng = np.random.RandomState(seed)
    return (rng.randint(0, 256, (n_train, h, w)).astype(np.uint8),
            rng.randint(0, 10, n_train).astype(np.uint8),
            rng.randint(0, 256, (n_test, h, w)).astype(np.uint8),
            rng.randint(0, 10, n_test).astype(np.uint8))


IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def write_idx_dir(directory, arrays, gz=False, names=IDX_FILES):
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, arr in zip(names, arrays):
        data = idx_bytes(arr)
        path = os.path.join(str(directory), name + (".gz" if gz else ""))
        with open(path, "wb") as f:
            f.write(gzip.compress(data) if gz else data)
        paths.append(path)
    return paths


def write_npz(path, arrays, **overrides):
    d = dict(zip(("x_train", "y_train", "x_test", "y_test"), arrays))
    d.update(overrides)
    d = {k: v for k, v in d.items() if v is not None}
    np.savez(str(path), **d)
    return str(path)


def check_matches(ds, arrays):
    x_train, y_train, x_test, y_test = arrays
    assert ds.name == "mnist"
    assert ds.image_shape == (28, 28, 1)
    assert ds.num_classes == 10
    assert ds.x_train.dtype == np.float32 and ds.x_train.shape == (12, 784)
    assert ds.x_test.shape == (5, 784)
    assert ds.y_train.dtype == np.int64
    np.testing.assert_array_equal(ds.y_train, y_train)
    np.testing.assert_array_equal(ds.y_test, y_test)
    np.testing.assert_allclose(ds.x_train, x_train.reshape(12, -1) / 255.0,
                               rtol=1e-6)
    np.testing.assert_allclose(ds.images("test")[..., 0], x_test / 255.0,
                               rtol=1e-6)
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0


@pytest.fixture(autouse=True)
def no_keras_cache(tmp_path, monkeypatch):
    """Points Keras's cache somewhere empty so a real ~/.keras is not used."""
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(datasets.tempfile, "gettempdir",
                        lambda: str(tmp_path / "tmp"))


# --------------------------------------------------------------------------
# Happy paths.


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_idx_dir(tmp_path, gz):
    arrays = fake_mnist()
    write_idx_dir(tmp_path / "m", arrays, gz=gz)
    ds = datasets.load_mnist(str(tmp_path / "m"))
    check_matches(ds, arrays)
    assert "MNIST" in ds.source and "IDX" in ds.source
    assert str(tmp_path / "m") in ds.source


def test_idx_dotted_mirror_names(tmp_path):
    arrays = fake_mnist()
    names = [n.replace("-idx", ".idx") for n in IDX_FILES]
    write_idx_dir(tmp_path, arrays, names=names)
    check_matches(datasets.load_mnist(str(tmp_path)), arrays)


def test_npz_dir_and_file(tmp_path):
    arrays = fake_mnist(seed=1)
    path = write_npz(tmp_path / "mnist.npz", arrays)
    check_matches(datasets.load_mnist(str(tmp_path)), arrays)
    ds = datasets.load_dataset(data_dir=path)
    check_matches(ds, arrays)
    assert path in ds.source


def test_keras_cache_is_found(tmp_path):
    arrays = fake_mnist(seed=2)
    cache = tmp_path / "keras_home" / "datasets"
    cache.mkdir(parents=True)
    write_npz(cache / "mnist.npz", arrays)
    ds = datasets.load_dataset()
    check_matches(ds, arrays)
    assert str(cache / "mnist.npz") in ds.source


def test_read_idx_other_types(tmp_path):
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 5.5
    path = tmp_path / "f.idx"
    path.write_bytes(idx_bytes(arr, type_code=0x0D))
    np.testing.assert_array_equal(datasets.read_idx(str(path)), arr)


# --------------------------------------------------------------------------
# Bad files: the message names the file and what was expected.


def corrupt(tmp_path, which, data, gz=False):
    write_idx_dir(tmp_path, fake_mnist(), gz=gz)
    path = os.path.join(str(tmp_path), IDX_FILES[which] + (".gz" if gz else ""))
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_bad_magic(tmp_path):
    data = idx_bytes(fake_mnist()[0])
    path = corrupt(tmp_path, 0, b"\x12\x34" + data[2:])
    with pytest.raises(datasets.DataFormatError) as e:
        datasets.load_mnist(str(tmp_path))
    msg = str(e.value)
    assert path in msg and "magic number 0x1234" in msg
    assert "0x00000803" in msg


def test_wrong_ndim(tmp_path):
    path = corrupt(tmp_path, 1, idx_bytes(np.zeros((12, 2), np.uint8)))
    with pytest.raises(datasets.DataFormatError,
                       match=r"2 dimension\(s\); expected 1") as e:
        datasets.load_mnist(str(tmp_path))
    assert path in str(e.value)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_truncated_data(tmp_path, gz):
    data = idx_bytes(fake_mnist()[0])[:-100]
    path = corrupt(tmp_path, 0, gzip.compress(data) if gz else data, gz=gz)
    with pytest.raises(datasets.DataFormatError) as e:
        datasets.load_mnist(str(tmp_path))
    msg = str(e.value)
    assert path in msg and "truncated" in msg
    assert "(12, 28, 28)" in msg and "9408 bytes" in msg and "9308" in msg


def test_truncated_header(tmp_path):
    path = corrupt(tmp_path, 2, idx_bytes(fake_mnist()[2])[:9])
    with pytest.raises(datasets.DataFormatError, match="truncated IDX header"):
        datasets.load_mnist(str(tmp_path))


def test_truncated_gzip_stream(tmp_path):
    data = gzip.compress(idx_bytes(fake_mnist()[0]))
    path = corrupt(tmp_path, 0, data[:len(data) // 2], gz=True)
    with pytest.raises(datasets.DataFormatError, match="gzip") as e:
        datasets.load_mnist(str(tmp_path))
    assert path in str(e.value)


def test_gz_name_without_gzip_data(tmp_path):
    path = corrupt(tmp_path, 3, idx_bytes(fake_mnist()[3]) + b"", gz=True)
    # Written raw under a .gz name.
    with pytest.raises(datasets.DataFormatError, match="not gzip") as e:
        datasets.load_mnist(str(tmp_path))
    assert path in str(e.value)


def test_count_mismatch(tmp_path):
    path = corrupt(tmp_path, 1, idx_bytes(np.zeros(11, np.uint8)))
    with pytest.raises(datasets.DataFormatError,
                       match="12 images but .* 11 labels") as e:
        datasets.load_mnist(str(tmp_path))
    assert path in str(e.value)


def test_some_idx_files_missing(tmp_path):
    write_idx_dir(tmp_path, fake_mnist())
    os.remove(os.path.join(str(tmp_path), IDX_FILES[3]))
    with pytest.raises(datasets.DataFormatError,
                       match="t10k-labels-idx1-ubyte"):
        datasets.load_mnist(str(tmp_path))


def test_npz_missing_key(tmp_path):
    path = write_npz(tmp_path / "mnist.npz", fake_mnist(), y_test=None)
    with pytest.raises(datasets.DataFormatError, match="missing array.*y_test"
                       ) as e:
        datasets.load_mnist(str(tmp_path))
    assert path in str(e.value)


def test_npz_truncated(tmp_path):
    path = write_npz(tmp_path / "mnist.npz", fake_mnist())
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 3])
    with pytest.raises(datasets.DataFormatError, match="npz") as e:
        datasets.load_mnist(str(tmp_path))
    assert path in str(e.value)


def test_npz_bad_shapes(tmp_path):
    arrays = fake_mnist()
    write_npz(tmp_path / "mnist.npz", arrays, x_train=arrays[0].reshape(12, -1))
    with pytest.raises(datasets.DataFormatError, match=r"x_train has shape"):
        datasets.load_mnist(str(tmp_path))


def test_npz_bad_labels(tmp_path):
    arrays = fake_mnist()
    write_npz(tmp_path / "mnist.npz", arrays,
              y_train=np.full(12, 10, np.uint8))
    with pytest.raises(datasets.DataFormatError, match=r"\[0, 10\)"):
        datasets.load_mnist(str(tmp_path))


def test_explicit_dir_without_mnist_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        datasets.load_dataset(data_dir=str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path) in msg and "train-images-idx3-ubyte" in msg
    assert "mnist.npz" in msg and "digits" in msg


def test_missing_dir_says_it_does_not_exist(tmp_path):
    with pytest.raises(datasets.MnistNotFoundError) as e:
        datasets.load_mnist(str(tmp_path / "nowhere"))
    assert not e.value.dir_exists
    assert "does not exist" in str(e.value)
    assert e.value.looked_for == datasets.mnist_file_names()


@pytest.mark.parametrize("content", ["random", "pickle"])
def test_npz_that_is_not_mnist_has_no_pickle_hint(tmp_path, content):
    path = str(tmp_path / "mnist.npz")
    if content == "random":
        with open(path, "wb") as f:
            f.write(np.random.RandomState(0).bytes(1000))
    else:  # a real zip whose array needs pickle
        arrays = dict(zip(("x_train", "y_train", "x_test", "y_test"),
                          fake_mnist()))
        arrays["x_train"] = np.array([{"a": 1}], dtype=object)
        np.savez(path, **arrays)
    with pytest.raises(datasets.DataFormatError) as e:
        datasets.load_mnist(str(tmp_path))
    msg = str(e.value)
    assert "%s is not a valid MNIST npz" % path in msg
    assert "allow_pickle" not in msg and "unsafely" not in msg


def test_mnist_only_without_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="Keras's cache"):
        datasets.load_dataset("mnist")


def test_bad_name():
    with pytest.raises(ValueError, match="'auto', 'mnist' or 'digits'"):
        datasets.load_dataset("cifar")


# --------------------------------------------------------------------------
# Download: opt-in only, clear failure offline (urlopen is mocked).


def test_download_offline(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request

    calls = []

    def offline(url, timeout=None):
        calls.append(url)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name "
                                    "resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    target = tmp_path / "dl"
    with pytest.raises(RuntimeError) as e:
        datasets.load_mnist(str(target), download=True)
    msg = str(e.value)
    assert calls == [datasets.MNIST_URL]
    assert "Could not download MNIST" in msg and datasets.MNIST_URL in msg
    assert "data_dir" in msg and "digits" in msg
    assert not os.path.exists(str(target / "mnist.npz"))
    assert not os.path.exists(str(target / "mnist.npz.part"))


def test_download_checksum_and_success(tmp_path, monkeypatch):
    import io
    import urllib.request

    payload = io.BytesIO()
    np.savez(payload, **dict(zip(("x_train", "y_train", "x_test", "y_test"),
                                 fake_mnist())))
    body = payload.getvalue()

    class Response(io.BytesIO):
        pass

    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda url, timeout=None: Response(body))
    with pytest.raises(RuntimeError, match="SHA-256"):
        datasets.load_mnist(str(tmp_path / "a"), download=True)
    # With the checksum of the fake file, the download is used.
    import hashlib
    monkeypatch.setattr(datasets, "MNIST_SHA256",
                        hashlib.sha256(body).hexdigest())
    check_matches(datasets.load_mnist(str(tmp_path / "b"), download=True),
                  fake_mnist())
    assert os.path.isfile(str(tmp_path / "b" / "mnist.npz"))


def test_no_download_without_opt_in(tmp_path, monkeypatch):
    import urllib.request

    def fail(*a, **k):
        raise AssertionError("must not touch the network")

    monkeypatch.setattr(urllib.request, "urlopen", fail)
    ds = datasets.load_dataset()
    assert ds.name == "digits"


# --------------------------------------------------------------------------
# Digits fallback.


def test_digits_fallback():
    ds = datasets.load_dataset()
    assert ds.name == "digits"
    assert "digits" in ds.source and "1,797" in ds.source
    assert ds.image_shape == (8, 8, 1) and ds.num_features == 64
    assert len(ds.x_train) + len(ds.x_test) == 1797
    assert 300 < len(ds.x_test) < 400
    assert ds.x_train.dtype == np.float32 and ds.x_train.max() == 1.0
    assert ds.x_train.min() == 0.0
    assert set(np.unique(ds.y_train)) == set(range(10))
    assert set(np.unique(ds.y_test)) == set(range(10))
    assert "1438 train / 359 test" in ds.describe()


def test_digits_split_is_seeded():
    a, b, c = (datasets.load_digits(seed=s) for s in (0, 0, 1))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.y_train, c.y_train)
    # Train and test are disjoint and cover every image.
    from sklearn.datasets import load_digits
    all_x = load_digits().data.astype(np.float32) / 16.0
    rows = {r.tobytes() for r in all_x}
    got = [r.tobytes() for r in np.concatenate([a.x_train, a.x_test])]
    assert len(got) == 1797 and set(got) == rows


def test_subset():
    ds = datasets.load_digits().subset(100, 20)
    assert ds.x_train.shape == (100, 64) and ds.y_test.shape == (20,)
    assert "subset" in ds.source


# --------------------------------------------------------------------------
# Batching.


def test_minibatches_cover_epoch_once():
    x = np.arange(50).reshape(25, 2)
    y = np.arange(25)
    batches = list(datasets.minibatches(x, y, 8, seed=3))
    assert [len(b[1]) for b in batches] == [8, 8, 8]
    seen = np.concatenate([b[1] for b in batches])
    assert len(set(seen)) == 24
    for xb, yb in batches:
        np.testing.assert_array_equal(xb[:, 0], 2 * yb)
    tail = list(datasets.minibatches(x, y, 8, seed=3, drop_remainder=False))
    assert [len(b[1]) for b in tail] == [8, 8, 8, 1]
    np.testing.assert_array_equal(
        np.sort(np.concatenate([b[1] for b in tail])), y)


def test_minibatches_seeded():
    x = y = np.arange(40)
    order = lambda **k: np.concatenate(
        [b[1] for b in datasets.minibatches(x, y, 10, **k)])
    np.testing.assert_array_equal(order(seed=1), order(seed=1))
    assert not np.array_equal(order(seed=1), order(seed=2))
    assert not np.array_equal(order(seed=1, epoch=0), order(seed=1, epoch=1))
    np.testing.assert_array_equal(order(shuffle=False), x)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size must be a positive int"),
    (dict(batch_size=2.5), "batch_size must be a positive int"),
    (dict(batch_size=100), "larger than the 10 examples"),
])
def test_minibatches_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        next(datasets.minibatches(np.zeros(10), np.zeros(10), **kwargs))


def test_minibatches_length_mismatch():
    with pytest.raises(ValueError, match="x has 10 examples but y has 9"):
        next(datasets.minibatches(np.zeros(10), np.zeros(9), 2))
