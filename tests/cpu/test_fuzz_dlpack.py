"""Property-based fuzzing of DLPack import and export (hypothesis).

Import: capsules are forged field by field with ctypes (tests/forge.py
forge_capsule), so every field a buggy producer controls can be wrong:
capsule name, version, flags, device, ndim, shape, strides, dtype code / bits
(sub-byte too) / lanes, data pointer, byte_offset, sizes that overflow int64.
Valid ones describe random host memory, so the result is checked against
NumPy's reading of the same bytes, and each forged tensor's deleter must
run exactly once.  Producer objects add malformed __dlpack_device__ and
__dlpack__ behaviour.  Export: random JAX arrays with malformed __dlpack__
and __cuda_array_interface__ arguments, read back by NumPy.
See fuzzing.py for the outcome rules and the budget.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st

import fuzzing as F  # noqa: E402
from fuzzing import fuzz_report, x64  # noqa: E402,F401  (module fixtures)
import jax_overlay
from jax_overlay import _dlpack as E
from jax_overlay import _runtime as rt
import forge as T
from jax_overlay import _xla_ext as ext

CPU = jax.devices("cpu")[0]
# What JAX holds, as DLPack (code, bits) with one lane, and its NumPy dtype.
HOLDABLE = {
    (6, 8): np.bool_, (0, 8): np.int8, (0, 16): np.int16, (0, 32): np.int32,
    (0, 64): np.int64, (1, 8): np.uint8, (1, 16): np.uint16, (1, 32): np.uint32,
    (1, 64): np.uint64, (2, 16): np.float16, (2, 32): np.float32, (2, 64): np.float64,
    (5, 64): np.complex64, (5, 128): np.complex128, (4, 16): ml_dtypes.bfloat16,
    (10, 8): ml_dtypes.float8_e4m3fn, (12, 8): ml_dtypes.float8_e5m2,
}
# Newer float8 codes: jaxlib may or may not know them (BufferError if not).
MAYBE = {(7, 8): ml_dtypes.float8_e3m4, (8, 8): ml_dtypes.float8_e4m3,
         (9, 8): ml_dtypes.float8_e4m3b11fnuz, (11, 8): ml_dtypes.float8_e4m3fnuz,
         (13, 8): ml_dtypes.float8_e5m2fnuz, (14, 8): ml_dtypes.float8_e8m0fnu}
SUB_BYTE = [(0, 1), (0, 2), (0, 4), (1, 1), (1, 2), (1, 4), (2, 4), (17, 4), (15, 6),
            (16, 6), (6, 1)]
NAMES = {False: b"dltensor", True: b"dltensor_versioned"}
KDL_GPU = (2, 3, 13)
# kDLCUDA* device types are only fuzzed where no GPU can take them: a GPU
# would view the host buffer as device memory, which no check can catch.
GPU_TYPES_SAFE = not any(d.platform == "gpu" for d in jax.devices())


def verdict(c):
    """(verdict, words, spec) for a forged capsule description `c` (a dict
    of forge_capsule's arguments, `device` being the advertised one): "ok",
    "bad" or "either", and the words an error may name: every problem found
    adds its words, since the consumer may report any of them first."""
    bad = set()
    name = c["name"]
    if name is None or name.split(b"\0")[0] != NAMES[c["versioned"]]:  # a C string
        bad.add("named")
    dl_type = c["device"][0]
    if dl_type not in (1, *KDL_GPU):
        bad.add("device type")
    elif dl_type != 1:
        bad.add("CUDA")  # no GPU here (GPU_TYPES_SAFE)
    if c["versioned"] and c["version"][0] > 1:
        bad.add("DLPack")
    code, bits, lanes = c["dtype"]
    key = (code, bits)
    if lanes != 1 or (key not in HOLDABLE and key not in MAYBE):
        bad.add("dtype")
    ndim, shape, strides = c["ndim"], c["shape"], c["strides"]
    if ndim < 0 or ndim > 64 or (ndim > 0 and shape is None):
        return "bad", bad | {"ndim"}, None
    shape = [] if shape is None else list(shape[:ndim])
    strides = None if strides is None else list(strides[:ndim])
    if any(n < 0 for n in shape):
        return "bad", bad | {"negative"}, None
    numel, overflowed = F.count_elements(shape)
    if overflowed:
        return ("bad" if bad or numel else "either"), bad | {"overflow"}, None
    env = F.envelope(shape, strides)
    if env is None:
        return "bad", bad | {"strides"}, None
    itemsize = (bits * lanes + 7) // 8
    low, span = env
    if span * itemsize > F.INT64_MAX:
        bad.add("overflows int64")
    address = c["data"] + c["byte_offset"]
    if numel:
        if c["data"] == 0:
            bad.add("null data pointer")
        elif address >= F.ADDRESS_END:
            bad.add("byte_offset")
        elif itemsize and (address + low * itemsize < 0
                           or address + (low + span) * itemsize > F.ADDRESS_END):
            bad.add("address")
    if bad:
        # A huge empty shape may fail first, in NumPy ("array is too big").
        return "bad", bad | ({"too big"} if F.huge_empty(shape, itemsize) else set()), None
    dtype = np.dtype(HOLDABLE.get(key) or MAYBE[key])
    spec = dict(shape=tuple(shape), dtype=dtype, numel=numel, address=address,
                strides=None if strides is None else [s * itemsize for s in strides])
    if key in MAYBE:
        return "either", {"dtype", "DLPack"}, spec
    if F.huge_empty(shape, itemsize):  # NumPy cannot even describe it
        return "either", {"too big", "shape"}, spec
    return "ok", set(), spec


# Generation ---------------------------------------------------------------

def draw_capsule(data):
    """(description, buffer): forge_capsule arguments over a random buffer,
    mostly valid, with up to three fields made wrong."""
    versioned = data.draw(st.booleans(), label="versioned")
    key = data.draw(st.sampled_from(list(HOLDABLE) + list(MAYBE)), label="dtype")
    itemsize = key[1] // 8
    ndim = data.draw(st.integers(0, 4), label="ndim")
    shape = [data.draw(st.integers(0, 5)) for _ in range(ndim)]
    strides = None
    if data.draw(st.booleans(), label="explicit strides"):
        strides = [data.draw(st.integers(-7, 7)) for _ in range(ndim)]
    misalign = data.draw(st.integers(0, 15), label="misalign bytes")
    low, span = F.envelope(shape, strides)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    buf = F.host_buffer(64 + -low * itemsize + misalign + max(span, 1) * 16 + 64, rng,
                        bool_bytes=key == (6, 8))
    start = buf.ctypes.data + 64 + -low * itemsize
    split = data.draw(st.integers(0, misalign), label="byte_offset part")
    c = dict(versioned=versioned, name=NAMES[versioned],
             version=(1, data.draw(st.integers(0, 3), label="minor")),
             flags=data.draw(st.sampled_from([0, 1, 2, 3, 4]), label="flags"),
             device=(1, 0), ndim=ndim, shape=shape, strides=strides,
             dtype=(key[0], key[1], 1), data=start + misalign - split, byte_offset=split)
    for _ in range(data.draw(st.sampled_from([0, 0, 1, 1, 2, 3]), label="mutations")):
        data.draw(st.sampled_from(MUTATIONS), label="mutate")(data, c)
    return c, buf


def m_name(data, c):
    c["name"] = data.draw(st.one_of(
        st.sampled_from([b"used_dltensor", b"used_dltensor_versioned", b"DLTensor",
                         b"dltensor\x00x", b"", None]),
        st.binary(max_size=12).filter(lambda b: b"\x00" not in b)), label="name")
    if c["name"] is not None and c["name"].split(b"\0")[0] in NAMES.values():
        c["name"] = NAMES[c["versioned"]] + b"\0x"  # the other kind's is unreadable


def m_version(data, c):
    if c["versioned"]:
        c["version"] = (data.draw(st.sampled_from([0, 1, 2, 3, 2**32 - 1])),
                        data.draw(st.sampled_from([0, 1, 7, 2**32 - 1])))


def m_flags(data, c):
    c["flags"] = data.draw(st.integers(0, 2**64 - 1), label="flags")


def m_device(data, c):
    types = [0, -1, 4, 7, 8, 9, 10, 11, 12, 14, 15, 17, 99, 2**31 - 1, -(2**31)]
    if GPU_TYPES_SAFE:
        types += list(KDL_GPU)
    c["device"] = (data.draw(st.sampled_from(types)),
                   data.draw(st.sampled_from([0, 1, -1, 2**31 - 1])))


def m_device_id(data, c):  # a CPU tensor's id is not an address: any will do
    c["device"] = (c["device"][0], data.draw(st.integers(-(2**31), 2**31 - 1)))


def m_ndim(data, c):
    how = data.draw(st.sampled_from(["negative", "too_many", "no_shape", "fewer"]))
    n = len(c["shape"] or ())
    if how == "negative":
        c["ndim"] = data.draw(st.sampled_from([-1, -64, -(2**31)]))
    elif how == "too_many":  # never read: the check comes first
        c["ndim"], c["shape"], c["strides"] = data.draw(
            st.sampled_from([65, 1000, 2**31 - 1])), None, None
    elif how == "no_shape":
        c["ndim"], c["shape"] = max(n, 1), None
    elif n:  # the consumer reads a prefix of the arrays: a smaller array
        c["ndim"] = data.draw(st.integers(0, n - 1))


def m_shape(data, c):
    shape = list(c["shape"] or [])
    how = data.draw(st.sampled_from(["negative", "overflow", "bytes_overflow",
                                     "zero_huge"]), label="shape mutation")
    if how == "negative" and shape:
        shape[data.draw(st.integers(0, len(shape) - 1))] = data.draw(
            st.sampled_from([-1, -(2**63)]))
    elif how == "overflow":
        shape = [data.draw(st.integers(2**32, 2**63 - 1)) for _ in range(2)]
        c["strides"] = None
    elif how == "bytes_overflow":
        shape, c["strides"] = [data.draw(st.integers(2**61, 2**63 - 1))], None
    elif how == "zero_huge":
        shape = [data.draw(st.sampled_from([0, 3, 2**31, 2**62, 2**63 - 1]))
                 for _ in range(data.draw(st.integers(1, 4)))]
        shape = shape + [0] if 0 not in shape else shape
        c["strides"] = None
    c["shape"], c["ndim"] = shape, len(shape)


def m_strides(data, c):
    if c["shape"]:
        c["strides"] = [data.draw(st.sampled_from([2**62, -(2**62), 2**63 - 1, -(2**63)]))
                        for _ in c["shape"]]


def m_dtype(data, c):
    c["dtype"] = data.draw(st.one_of(
        st.sampled_from(SUB_BYTE).map(lambda k: (*k, 1)),
        st.tuples(st.sampled_from([0, 1, 2, 4, 5, 6]), st.sampled_from([8, 16, 32, 64]),
                  st.sampled_from([0, 2, 4, 65535])),
        st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 65535))),
        label="dtype")


def m_data(data, c):
    c["data"] = data.draw(st.one_of(
        st.just(0), st.integers(2**64 - 64, 2**64 - 1)), label="data")


def m_byte_offset(data, c):
    c["byte_offset"] = data.draw(st.one_of(
        st.integers(2**64 - 2**20, 2**64 - 1),
        st.integers(0, 15).map(lambda k: -k)), label="byte_offset")
    if c["byte_offset"] <= 0:  # move the pointer down, the offset up: same address
        c["data"], c["byte_offset"] = c["data"] + c["byte_offset"], -c["byte_offset"]


MUTATIONS = [m_name, m_version, m_flags, m_device, m_device_id, m_ndim, m_shape,
             m_strides, m_dtype, m_data, m_byte_offset]


def forge(c, buf):
    cap, key = T.forge_capsule(
        data=c["data"], device=c["device"], ndim=c["ndim"], dtype=c["dtype"],
        shape=c["shape"], strides=c["strides"], byte_offset=c["byte_offset"],
        versioned=c["versioned"], version=c["version"], flags=c["flags"],
        name=False if c["name"] is None else c["name"], keep=buf)
    return cap, key


def right_array(spec, buf, copy, producer_copied=False):
    ref = None
    if spec is not None and spec["numel"]:
        ref = F.reference(buf, spec["address"], spec["shape"], spec["dtype"],
                          spec["strides"])

    def check(arr):
        if arr.shape != spec["shape"] or arr.dtype != spec["dtype"]:
            return False
        if not spec["numel"]:
            return True
        ptr = arr.unsafe_buffer_pointer()
        if copy is False and ptr != spec["address"]:
            return False
        if copy is True and ptr == spec["address"] and not producer_copied:
            return False  # copy=True copies, unless the producer says it did (IS_COPIED)
        return F.same_data(arr, ref)

    return ref, check


def run_forged(c, buf, copy, make_input, prop, advertised=None):
    """Forges `c`, imports make_input(capsule) and checks the outcome and the
    release of the tensor.  `advertised`: the device the producer object
    claims, which is where the memory is, whatever the capsule says."""
    v, words, spec = verdict(c if advertised is None else dict(c, device=advertised))
    ref, check = right_array(spec, buf, copy,
                             producer_copied=c["versioned"] and bool(c["flags"] & 2))
    if spec is not None and spec["numel"]:
        assume(ref is not None)  # outside the buffer: no consumer survives it
    if copy is False and v in ("ok", "either"):
        v, words = "either", words | {"without a copy"}
    del ref
    live, deletes_before = ext.live_tensors(), T.forged_deletes.get(-1, 0)
    cap, key = forge(c, buf)
    x = make_input(cap)
    del cap
    outcome = F.check_outcome(lambda: jax_overlay.from_dlpack(x, copy=copy), v, words,
                              check_array=check)
    del x
    T.settle(lambda: T.forged_deletes.get(key) == 1 and ext.live_tensors() == live,
             f"forged tensor deleted {T.forged_deletes.get(key, 0)} times, "
             f"{ext.live_tensors() - live} native tensors left")
    assert T.forged_deletes.get(-1, 0) == deletes_before, "a deleter ran for a freed tensor"
    F.tally.add(prop, outcome)


# Properties ---------------------------------------------------------------

@F.fuzz_settings(ci=400)
@given(data=st.data())
def test_import_any_capsule(data, x64):
    """from_dlpack on a raw forged capsule: a clear error or exactly the
    described array; the producer's deleter runs exactly once."""
    c, buf = draw_capsule(data)
    copy = data.draw(st.sampled_from([None, None, True, False]), label="copy")
    run_forged(c, buf, copy, lambda cap: cap, "dlpack_import_capsule")


class Producer:
    """A __dlpack__ producer with drawn misbehaviour."""

    def __init__(self, cap, device, mode):
        self.cap, self.device, self.mode = cap, device, mode

    def __dlpack_device__(self):
        if self.mode == "device_raises":
            raise RuntimeError("producer failure")
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if self.mode == "legacy_only" and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        if self.mode == "refuses":
            raise BufferError("this producer cannot export")
        if self.mode == "not_a_capsule":
            return self.device
        cap, self.cap = self.cap, None
        return cap


def int_pair(value):
    """What the DLPack protocol calls a device or a version: a tuple (or
    list) of two integers, or None."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return None
    try:
        return operator.index(value[0]), operator.index(value[1])
    except TypeError:
        return None


def advertised_pair(value):
    """A producer's __dlpack_device__ as from_dlpack reads it: int_pair, and
    also numbers with integral values (stock JAX unpacks the pair and looks
    the type up by equality, so (1.0, 0) is the CPU)."""
    pair = int_pair(value)
    if pair is not None or not isinstance(value, (tuple, list)) or len(value) != 2:
        return pair
    if all(isinstance(v, float) and v.is_integer() or F.is_int(v) for v in value):
        return int(value[0]), int(value[1])
    return None


@F.fuzz_settings(ci=200)
@given(data=st.data())
def test_import_any_producer(data, x64):
    """from_dlpack on producer objects: malformed __dlpack_device__ results,
    legacy-only producers, refusals, non-capsules."""
    c, buf = draw_capsule(data)
    mode = data.draw(st.sampled_from(["plain", "plain", "legacy_only", "refuses",
                                      "not_a_capsule", "device_raises"]), label="mode")
    device = data.draw(st.one_of(
        st.just(c["device"]), st.just(list(c["device"])),
        st.sampled_from([None, (1,), (1, 0, 0), "10", (1.0, 0), (1, "0"), (np.int32(1), 0),
                         (True, 0), 1])), label="advertised")
    if mode == "legacy_only":
        c.update(versioned=False, name=NAMES[False])
    advertised = advertised_pair(device) if mode != "device_raises" else None
    copy = data.draw(st.sampled_from([None, True, False]), label="copy")
    mode_words = {"refuses": {"cannot export"}, "not_a_capsule": {"capsule"}}
    if mode == "device_raises":
        expect = ("raises", {"producer failure"})
    elif advertised is None:
        expect = ("bad", {"__dlpack_device__"})
    elif advertised[0] not in (1, *KDL_GPU) or (advertised[0] != 1 and not GPU_TYPES_SAFE):
        expect = ("bad", {"device type"})
    elif advertised[0] == 1 and rt.cpu_device(advertised[1]) is None:
        # A CPU device this process lacks: stock's lookup error, before the
        # producer is asked for anything.
        expect = ("bad", {"does not have"})
    elif mode in mode_words:
        # Pinned memory (kDLCUDAHost) needs no stream, so its missing GPU may
        # only show after the producer was asked.
        expect = ("bad", mode_words[mode] | ({"CUDA"} if advertised[0] != 1 else set()))
    else:
        expect = None
    if expect is None:
        run_forged(c, buf, copy, lambda cap: Producer(cap, device, mode),
                   "dlpack_import_producer", advertised=advertised)
        return
    kind, words = expect
    live = ext.live_tensors()
    cap, key = forge(c, buf)
    producer = Producer(cap, device, mode)
    del cap
    if kind == "raises":
        with pytest.raises(RuntimeError, match="producer failure"):
            jax_overlay.from_dlpack(producer, copy=copy)
        outcome = "RuntimeError"
    else:
        outcome = F.check_outcome(lambda: jax_overlay.from_dlpack(producer, copy=copy), "bad", words,
                                  check_array=lambda a: False)
    del producer
    T.settle(lambda: T.forged_deletes.get(key) == 1 and ext.live_tensors() == live,
             "a forged tensor or a native tensor was not released exactly once")
    F.tally.add("dlpack_import_producer", outcome)


# Export -------------------------------------------------------------------

EXPORT_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32,
                 np.float16, np.float32, np.float64, np.complex64, np.complex128,
                 jnp.bfloat16, jnp.float8_e4m3fn, jnp.int4]
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(), st.text(max_size=3),
                 st.tuples(st.integers(-2, 3), st.integers(-2, 3)),
                 st.lists(st.integers(-2, 3), max_size=3), st.just((1, 0, 0)), st.just(b"x"))


def export_verdict(dtype, stream, max_version, dl_device, copy):
    """Which export requests must fail, and why (by the words the error names)."""
    bad = set()
    # A stream jaxlib can take (an int64; bools are ints to it): a CPU array
    # serves any, the host waits for the array instead.
    if stream is not None and not (isinstance(stream, int) and F.fits_int64(int(stream))):
        bad.add("stream")
    # Read as stock JAX reads them (the drop-in rule): max_version compared
    # with stock's versions as a tuple (below (0, 5) refused), and where
    # jaxlib takes it itself (0.12) two ints; dl_device unpacked when truthy
    # (a device type 0 names none), copy= taken by its truth.
    if max_version is not None:
        stock = rt.stock_dlpack()
        try:
            known = (max_version >= tuple(stock.DLPACK_VERSION)
                     or max_version >= tuple(stock.MIN_DLPACK_VERSION))
        except (TypeError, ValueError):
            known = False
        two_ints = (isinstance(max_version, (tuple, list)) and len(max_version) == 2
                    and all(isinstance(v, int) for v in max_version))
        if not known or (rt.NATIVE_DLPACK_1 and not two_ints):
            bad.add("max_version")
    device = advertised_pair(dl_device) if dl_device else None
    if dl_device and (device is None or device[0] not in (0, 1)):
        bad.add("dl_device")  # malformed, or a copy to a device a CPU run lacks
    elif device is not None and device[0] == 1 and device[1] != 0:
        bad.add("dl_device")  # a CPU device this process does not have
    if dtype in (jnp.int4,):
        bad.add("DLPack")
    return bad


@F.fuzz_settings(ci=200)
@given(data=st.data())
def test_export_any_request(data, x64):
    """to_dlpack with malformed stream / max_version / dl_device / copy on
    random CPU arrays: a clear error, or a capsule NumPy reads back right."""
    dtype = data.draw(st.sampled_from(EXPORT_DTYPES), label="dtype")
    shape = tuple(data.draw(st.lists(st.integers(0, 4), max_size=3), label="shape"))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    host = rng.integers(0, 2 if dtype == np.bool_ else 8, shape).astype(dtype)
    x = jax.device_put(host, CPU)
    args = {k: data.draw(JUNK if data.draw(st.integers(0, 3)) == 0 else good, label=k)
            for k, good in [
        ("stream", st.sampled_from([None, -1])),
        ("max_version", st.sampled_from([None, (1, 0), (1, 1), (0, 8), (2, 0)])),
        ("dl_device", st.sampled_from([None, (1, 0)])),
        ("copy", st.sampled_from([None, True, False]))]}
    bad = export_verdict(dtype, **args)
    live = ext.live_tensors()

    def run():
        cap = E.to_dlpack(x, **args)
        if np.dtype(dtype).kind == "V":
            return np.asarray(jax_overlay.from_dlpack(cap))  # NumPy has no such dtypes
        return np.from_dlpack(T.DLPackHolder(cap))

    def right(arr):
        return arr.shape == host.shape and arr.dtype == host.dtype and (
            host.size == 0 or arr.tobytes() == host.tobytes())

    outcome = F.check_outcome(run, "bad" if bad else "ok", bad, check_array=right)
    del x
    T.settle(lambda: ext.live_tensors() == live, "an exported tensor was not released")
    F.tally.add("dlpack_export", outcome)
