"""CUDA code generation and build.

``render(plan)`` produces two sources from jinja2 templates (``templates/``, rendered with
``StrictUndefined``): ``tilec_layout.h``, generated from the single Python definition of
the descriptor and operand-table layouts (``tilec.plan``) and the op registry's opcodes,
and ``program.cu``, which includes the hand-written ``runtime/tilec/*.cuh`` headers and
instantiates exactly the (op, dtypes, shape class) variants the plan uses. ``build`` compiles them with
nvcc into a shared library with a plain ``extern "C"`` ABI (no torch headers).
``render_tables(plan)`` emits the plan's tables as C++ constant arrays (``tables.h``) for
artifacts; they are not part of the build, so a new plan of the same variants never rebuilds.
"""
from __future__ import annotations

from .sources import ABI_VERSION, render, render_tables, variants
from .build import build, nvcc_version, runtime_dir

__all__ = ["render", "render_tables", "variants", "build", "nvcc_version", "runtime_dir", "ABI_VERSION"]
