"""The CAI parser: every field validated, with errors that name the field."""

import numpy as np
import pytest

import forge as T
from jax_overlay import _xla_ext as ext


def cai(**over):
    d = {"shape": (2, 3), "typestr": "<f4", "data": (4096, False),
         "version": 3, "strides": None, "stream": None, "descr": [("", "<f4")]}
    for k, v in over.items():
        if v is KeyError:
            d.pop(k)
        else:
            d[k] = v
    return d


def test_valid_fields():
    v = ext.parse_cai(cai(strides=(4, 8), stream=7, data=(8192, True)))
    assert (v.shape, v.strides, v.typestr, v.itemsize) == ((2, 3), (1, 2), "<f4", 4)
    assert (v.data, v.read_only, v.stream, v.version) == (8192, True, 7, 3)
    assert v.layout == "permuted" and v.numel == 6


@pytest.mark.parametrize("typestr,itemsize", [
    ("|b1", 1), ("|i1", 1), ("<i2", 2), ("<i4", 4), ("<i8", 8), ("|u1", 1),
    ("<u2", 2), ("<u4", 4), ("<u8", 8), ("<f2", 2), ("<f4", 4), ("<f8", 8),
    ("<c8", 8), ("<c16", 16), ("=f4", 4), (">i1", 1), ("<b1", 1)])
def test_every_jax_dtype(typestr, itemsize):
    assert ext.parse_cai(cai(typestr=typestr)).itemsize == itemsize


def test_stream_ignored_before_v3():
    assert ext.parse_cai(cai(version=2, stream=0)).stream is None
    assert ext.parse_cai(cai(version=2, stream=KeyError)).stream is None


@pytest.mark.parametrize("stream", [1, 2, 0xDEADBEEF00, 2**64 - 1])
def test_streams(stream):
    assert ext.parse_cai(cai(stream=stream)).stream == stream


def test_zero_size_and_0d():
    assert ext.parse_cai(cai(shape=(0, 5), data=(0, False))).numel == 0
    v = ext.parse_cai(cai(shape=(), strides=()))
    assert v.numel == 1 and v.shape == ()


def test_list_forms_accepted():
    v = ext.parse_cai(cai(shape=[2, 3], data=[4096, False], strides=[12, 4]))
    assert v.layout == "row_major"


BAD = [
    # (override, exception, words the message must contain)
    (dict(), None, None),
    (dict(version=KeyError), TypeError, ["'version'"]),
    (dict(version="3"), TypeError, ["version", "'3'"]),
    (dict(version=True), TypeError, ["version"]),
    (dict(version=4), BufferError, ["version", "4", "0 to 3"]),
    (dict(version=-1), BufferError, ["version", "-1"]),
    (dict(shape=KeyError), TypeError, ["'shape'"]),
    (dict(shape=5), TypeError, ["shape", "tuple"]),
    (dict(shape=(2, "3")), TypeError, ["shape", "'3'"]),
    (dict(shape=(2, 3.0)), TypeError, ["shape", "3.0"]),
    (dict(shape=(2, -3)), ValueError, ["shape", "negative"]),
    (dict(shape=(2**63, 1)), ValueError, ["shape", "int64"]),
    (dict(shape=(2**40, 2**40)), ValueError, ["overflows"]),
    (dict(shape=(2**31, 2**31), typestr="<c16"), ValueError, ["overflows int64"]),
    (dict(shape=(1,) * 65), ValueError, ["65", "64"]),
    (dict(typestr=KeyError), TypeError, ["'typestr'"]),
    (dict(typestr=b"<f4"), TypeError, ["typestr", "str"]),
    (dict(typestr=">f4"), TypeError, ["'>f4'", "big-endian"]),
    (dict(typestr="<f16"), TypeError, ["'<f16'", "<f4"]),
    (dict(typestr="<V2"), TypeError, ["'<V2'"]),
    (dict(typestr="<M8"), TypeError, ["'<M8'"]),
    (dict(typestr="|O8"), TypeError, ["'|O8'"]),
    (dict(typestr="f4"), TypeError, ["'f4'"]),
    (dict(typestr="<fx"), TypeError, ["'<fx'"]),
    (dict(typestr="<b2"), TypeError, ["'<b2'"]),
    # Read to its end, not to the first NUL (it used to parse as '<f4').
    (dict(typestr="<f4\x00junk"), TypeError, ["typestr", "'<f4\\x00junk'", "NUL"]),
    (dict(typestr="<f4\x00"), TypeError, ["typestr", "NUL"]),
    (dict(data=KeyError), TypeError, ["'data'"]),
    (dict(data=4096), TypeError, ["data", "tuple"]),
    (dict(data=(4096,)), TypeError, ["data"]),
    (dict(data=(4096, 0)), TypeError, ["read_only", "bool"]),
    (dict(data=("4096", False)), TypeError, ["data", "'4096'"]),
    (dict(data=(-8, False)), ValueError, ["data", "non-negative"]),
    (dict(data=(2**64, False)), ValueError, ["data", "64 bits"]),
    (dict(data=(0, False)), ValueError, ["null pointer", "zero-size"]),
    (dict(strides=(4,)), ValueError, ["strides", "1 entries", "2"]),
    (dict(strides=(12, 2)), ValueError, ["strides", "multiples", "4"]),
    (dict(strides=(12, "4")), TypeError, ["strides"]),
    (dict(strides=12), TypeError, ["strides", "tuple"]),
    (dict(strides=(2**62, 2**62)), ValueError, ["strides", "int64"]),
    (dict(strides=(-12, 4), data=(8, False)), ValueError, ["below address 0"]),
    # 24 bytes from 2**64 - 16 would wrap around to address 8.
    (dict(data=(2**64 - 16, False)), ValueError, ["data", "18446744073709551600",
                                                  "past the top of the 64-bit address space"]),
    (dict(data=(2**64 - 24, False)), None, None),
    (dict(mask=np.zeros(6, bool)), BufferError, ["mask", "masked"]),
    (dict(stream=0), ValueError, ["stream", "0", "forbids"]),
    (dict(stream=-2), ValueError, ["stream", "non-negative"]),
    (dict(stream=1.0), TypeError, ["stream", "float"]),
    (dict(stream=True), TypeError, ["stream", "bool"]),
]


@pytest.mark.parametrize("over,exc,words", BAD, ids=[str(b[0])[:60] for b in BAD])
def test_bad_inputs(over, exc, words):
    d = cai(**over)
    if exc is None:
        ext.parse_cai(d)
        return
    with pytest.raises(exc) as info:
        ext.parse_cai(d)
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)


def test_not_a_dict():
    with pytest.raises(TypeError, match="must be a dict, got list"):
        ext.parse_cai([1, 2])


def test_mask_none_is_fine():
    """mask=None means no mask (the CAI spec): the parse and the import go on
    as if the field were absent."""
    v = ext.parse_cai(cai(mask=None))
    assert (v.shape, v.strides, v.typestr, v.itemsize) == ((2, 3), None, "<f4", 4)
    assert (v.data, v.read_only, v.numel) == (4096, False, 6)
    a = T.aligned_empty((2, 3), np.float32)
    a[...] = np.arange(6).reshape(2, 3)
    x = T.import_host(T.HostCAI(a, mask=None))
    assert (x.dtype, x.shape) == (np.float32, (2, 3))
    np.testing.assert_array_equal(np.asarray(x), a)
