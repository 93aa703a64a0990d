"""Builds the preload shim (shim/shim.c) as part of the package's own install: it ships inside
the package as convgpu/libconvgpu*.so (a plain shared library for LD_PRELOAD, not a Python
module; `convgpu shim --print-env` finds it). Everything else is in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "convgpu.libconvgpu", sources=["shim/shim.c"], depends=["shim/hooks.h"],
    extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wextra"],
    libraries=["dl", "pthread"])])
