"""The one table of what the running jaxlib does natively (_runtime.NATIVE,
keyed by jaxlib's extension version), checked against what that jaxlib
actually offers: the table's versions must not drift from the features."""

from jax._src import dlpack as stock_dlpack
from jax._src.lib import _jax

from jax_overlay import _runtime as rt
from jax_overlay import _vocab


def test_pinned_views_where_jaxlib_takes_a_device_type():
    doc = _jax.dlpack_managed_tensor_to_buffer.__doc__ or ""
    assert rt.NATIVE["pinned_view"] == ("dl_device_type" in doc), doc.splitlines()[:1]
    assert rt.PINNED_VIEW is rt.NATIVE["pinned_view"]


def test_dlpack_1_where_jax_asks_for_it():
    assert rt.NATIVE["dlpack_1"] == (tuple(stock_dlpack.DLPACK_VERSION) >= (1, 0))
    assert rt.NATIVE_DLPACK_1 is rt.NATIVE["dlpack_1"]


def test_one_entry_per_capability():
    assert set(rt.NATIVE) == set(rt.NATIVE_SINCE)
    assert all(type(v) is int and v > 0 for v in rt.NATIVE_SINCE.values())
    assert rt.EXTENSION_VERSION > 0


def test_host_alignment_is_the_running_jaxlibs():
    """The native core's host view rule (_vocab.HOST_ALIGNMENT, stated in
    xla_ext/import_plan.h) is the one XLA's CPU client enforces: it views
    memory aligned to it, and refuses half of it."""
    import jax
    import numpy as np
    import pytest

    from jax_overlay import _vocab
    cpu = jax.devices("cpu")[0]
    buf = np.zeros(4 * _vocab.HOST_ALIGNMENT + 256, np.uint8)
    start = -buf.ctypes.data % (2 * _vocab.HOST_ALIGNMENT)

    def view(offset):
        a = buf[start + offset:start + offset + 64].view(np.float32)
        return rt.capsule_to_array(a.__dlpack__(), cpu, None, False, _vocab.KDLCPU)

    assert view(0).unsafe_buffer_pointer() == buf.ctypes.data + start
    with pytest.raises(Exception, match="align"):
        view(_vocab.HOST_ALIGNMENT // 2)


def test_one_alignment_rule_per_memory_kind():
    """Both imports' rule (xla_ext's ViewAlignment): the CAI plan applies it
    natively, the DLPack import through _vocab.view_alignment."""
    rule = {t: _vocab.view_alignment(t) for t in (_vocab.KDLCPU, _vocab.KDLCUDA,
                                                  _vocab.KDLCUDAHOST, _vocab.KDLCUDAMANAGED)}
    assert rule == {_vocab.KDLCPU: _vocab.HOST_ALIGNMENT, _vocab.KDLCUDA: _vocab.GPU_ALIGNMENT,
                    _vocab.KDLCUDAHOST: 1, _vocab.KDLCUDAMANAGED: _vocab.GPU_ALIGNMENT}
