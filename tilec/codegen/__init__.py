"""CUDA code generation and build.

``render(plan)`` produces two sources from jinja2 templates (``templates/``, rendered with
``StrictUndefined``): ``tilec_layout.h``, generated from the single Python definition of
the descriptor and operand-table layouts (``tilec.plan``) and the op registry's opcodes,
and ``program.cu``, which includes the hand-written ``runtime/tilec/*.cuh`` headers and
instantiates exactly the (op, dtype) variants the plan uses. ``build`` compiles them with
nvcc into a shared library with a plain ``extern "C"`` ABI (no torch headers).
"""
from __future__ import annotations

from .sources import ABI_VERSION, render, variants
from .build import build, nvcc_version, runtime_dir

__all__ = ["render", "variants", "build", "nvcc_version", "runtime_dir", "ABI_VERSION"]
