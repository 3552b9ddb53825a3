"""The public exception classes: one public module, jax_overlay.errors, and
no class that prints under a builtin's name."""

import builtins
import pickle

import pytest
from jax.errors import JaxRuntimeError

import jax_overlay
from jax_overlay import errors


@pytest.mark.parametrize("name", ["CopyRequiredError", "LayoutCopyRequiredError",
                                  "NoCudaError", "ForeignError"])
def test_public_classes_live_in_the_public_module(name):
    cls = getattr(errors, name)
    assert cls.__module__ == "jax_overlay.errors"
    assert cls.__qualname__ == name
    if hasattr(jax_overlay, name):
        assert getattr(jax_overlay, name) is cls


@pytest.mark.parametrize("ours, stock, name", [
    (BufferError, TypeError, "BufferTypeError"),
    (TypeError, ValueError, "TypeValueError"),
    (BufferError, JaxRuntimeError, "BufferJaxRuntimeError"),
    (errors.CopyRequiredError, TypeError, "CopyRequiredTypeError"),
])
def test_joined_classes_are_named_after_both_and_pickle(ours, stock, name):
    e = errors.like_stock(ours("the words"), stock)
    cls = type(e)
    assert isinstance(e, ours) and isinstance(e, stock)
    assert (cls.__module__, cls.__name__, cls.__qualname__) == ("jax_overlay.errors", name, name)
    assert not hasattr(builtins, cls.__name__)
    assert getattr(errors, name) is cls  # reachable by name: pickles
    assert "the words" in str(e)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == str(e)
    assert errors.like_stock(ours("again"), stock).__class__ is cls  # one class per pair


def test_an_instance_of_stocks_class_is_kept():
    e = ValueError("x")
    assert errors.like_stock(e, ValueError) is e
