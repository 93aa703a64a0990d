"""Builds the preload shim (shim/shim.c) as part of the package's own install: it ships inside
the package as convgpu/libconvgpu*.so (a plain shared library for LD_PRELOAD, not a Python
module; `convgpu shim --print-env` finds it), with convgpu/libcredit*.so, the enforcer's atomic
operations on the shim's credit pages (shim/credit.h). An editable install builds them in place
into core/ (the package's own folder: pyproject.toml's package-dir). Everything else is in
pyproject.toml."""
from setuptools import Extension, setup

FLAGS = ["-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wextra"]

setup(ext_modules=[
    Extension("convgpu.libconvgpu", sources=["shim/shim.c"], depends=["shim/hooks.h", "shim/credit.h"],
              extra_compile_args=FLAGS, libraries=["dl", "pthread"]),
    Extension("convgpu.libcredit", sources=["shim/credit.c"], depends=["shim/credit.h"],
              extra_compile_args=FLAGS)])
