"""The C++ CPU kernels build wherever a compiler is present.

A kernel whose build fails falls back to the plain-jnp reference with only a logged
warning, and each kernel's own tests skip when it is unavailable: without this check a
compile error would show up in CI as skips, not as a failure.
"""

import importlib

import pytest

from pallas_kernels import _cpu_build

KERNELS = ("dense_matmul", "quantized_matmul", "ragged_paged_attention", "sampling")


@pytest.mark.skipif(_cpu_build.compiler() is None or not _cpu_build.enabled(),
                    reason="no C++ compiler here (or JAXPAGE_CPU_KERNELS=0)")
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_builds_where_a_compiler_is_present(kernel):
    module = importlib.import_module(f"pallas_kernels.{kernel}.cpu")
    assert module.available(), (f"pallas_kernels/{kernel}/cpu_kernel.cc did not build with "
                                f"{_cpu_build.compiler()}: see the warning logged above")


@pytest.mark.skipif(_cpu_build.compiler() is None, reason="no C++ compiler here")
def test_a_source_that_does_not_compile_falls_back_without_raising(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_cpu_build, "_cache_root", lambda: tmp_path / "cache")
    source = tmp_path / "broken_kernel.cc"
    source.write_text("this is not C++;\n")
    with caplog.at_level("WARNING"):
        assert _cpu_build.load(source) is None
    assert "building broken_kernel.cc failed" in caplog.text
