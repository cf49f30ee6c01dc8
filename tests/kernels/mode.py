"""How the kernel tests run the Pallas kernels: interpret mode on the CPU (the default),
or compiled on the device they are built for (``JAXPAGE_KERNELS_ON_DEVICE=1``, on a GPU
or TPU machine: ``scripts/accelerator_check.sh``). On a device only that device's
backend runs; tests of the other backend are skipped, and so are interpret-mode-only
tests (interpret mode's NaN poisoning of outputs)."""

from __future__ import annotations

import os

import pytest

from pallas_kernels import _backend

ON_DEVICE = os.environ.get("JAXPAGE_KERNELS_ON_DEVICE") == "1"
INTERPRET = not ON_DEVICE
BACKENDS = [_backend.platform_backend()] if ON_DEVICE else ["gpu", "tpu"]


def require_backend(backend: str) -> None:
    """Skip a test written for one backend when the device runs another."""
    if ON_DEVICE and backend not in BACKENDS:
        pytest.skip(f"{backend} kernel: this device runs {BACKENDS}")


interpret_only = pytest.mark.skipif(ON_DEVICE, reason="checks interpret mode itself")
