"""The cuda.core peer (jax_overlay/peers/cuda_core.py) on the CPU: its
recognition rule, its route (DLPack only) and the fence its capability
asks for (peers.resolve waits for the device before the capsule is
taken).  What the fence buys, an in-flight producer read right, is proven
on the GPU (tests/gpu/test_cuda_core_gpu.py)."""

import numpy as np
import pytest

import jax_overlay
from jax_overlay import _route, peers
from jax_overlay._vocab import KDLCPU, KDLCUDA


def _type(name, module="cuda.core._memoryview"):
    return type(name, (), {"__module__": module})


class _Producer:
    def __init__(self, device):
        self.device = device
        self.a = np.arange(6, dtype=np.float32)

    def __dlpack__(self, stream=None, **kwargs):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.device


def _fake(name, device):
    return type(name, (_Producer,), {"__module__": "cuda.core._memory._buffer"})(device)


@pytest.mark.parametrize("name", ["StridedMemoryView", "Buffer"])
def test_its_types_are_recognised_by_name_and_module(name):
    assert peers.peer_of(_type(name)).name == "cuda_core"
    assert peers.peer_of(type("Sub", (_type(name),), {})).name == "cuda_core"  # a subclass
    assert peers.peer_of(_type(name, "elsewhere")) is None
    assert peers.peer_of(_type("Stream")) is None


def test_it_says_it_does_not_order_the_consumer_stream():
    peer = peers.REGISTRY["cuda_core"]
    assert peer.orders_consumer_stream is False
    assert all(p.orders_consumer_stream for n, p in peers.REGISTRY.items() if n != "cuda_core")
    assert _route.cai_route(_fake("StridedMemoryView", (KDLCPU, 0))) is None  # DLPack only


def test_resolve_fences_its_gpu_producers_only(monkeypatch):
    fenced = []
    monkeypatch.setattr(peers.ext, "synchronize", fenced.append)
    gpu = _fake("StridedMemoryView", (KDLCUDA, 3))
    assert peers.resolve(gpu, None) == (gpu, False)
    assert fenced == [3]
    peers.resolve(_fake("Buffer", (KDLCPU, 0)), None)  # host memory: nothing to wait for
    other = _Producer((KDLCUDA, 1))  # a producer no peer describes orders itself
    peers.resolve(other, None)
    assert fenced == [3]


def test_a_host_view_imports_through_dlpack():
    x = jax_overlay.from_dlpack(_fake("StridedMemoryView", (KDLCPU, 0)))
    np.testing.assert_array_equal(np.asarray(x), np.arange(6, dtype=np.float32))
