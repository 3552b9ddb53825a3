"""PyTorch for the CPU test files that need it: skipped where it is not
installed, except in the run that installed it for them (.ci/run sets
JAX_OVERLAY_REQUIRE_TORCH=1 there), where a skip would pass with the tests
unrun: there a missing PyTorch fails."""

from __future__ import annotations

import os

import pytest


def torch():
    if os.environ.get("JAX_OVERLAY_REQUIRE_TORCH", "0") not in ("", "0"):
        try:
            import torch as module
        except ImportError as e:
            raise ImportError(f"JAX_OVERLAY_REQUIRE_TORCH is set, but PyTorch does not "
                              f"import: {e}") from e
        return module
    return pytest.importorskip("torch", reason="PyTorch is not installed (CI: .ci/run installs "
                               "the CPU build where its wheel lies on the machine)")
