"""Compiler passes. ``split_kv`` (split-KV / flash-decoding attention), ``fuse_gemv_chains``
(RMSNorm / SiLU-mul / residual-add fusion into GEMVs), ``fuse_fp8_quant`` / ``fuse_index_quant`` (FP8
activation quantization into the FP8 GEMMs and the indexer score), ``fold_casts`` (a float32 op's output
cast into the op), ``fold_cache_writes`` (RoPE writing
the KV-cache slot directly), ``fold_rope`` (the queries' RoPE into the split-KV attention tiles) and
``fold_kv_append`` (the keys' RoPE and the step's cache writes into those tiles) and ``fold_combine``
(the split-KV combine run by each head group's last partial tile) rewrite the OpGraph,
and ``size_gemv_groups`` sizes sibling GEMVs' tiles by their total columns;
the rest are MPK-style passes over the TaskGraph (Mirage Persistent Kernel, arXiv 2512.22219,
section 4).

The pipeline (``tilec.pipeline``) runs, in order:
  split_kv -> fold_casts + fuse_gemv_chains + fuse_fp8_quant -> fold_cache_writes -> size_gemv_groups + fold_rope + fold_kv_append
  + fold_combine -> (build_taskgraph)
  -> fuse_events -> normalize -> linearize -> schedule
and runs the stage verifier (``tilec.verify``) after each one when ``Options.verify`` is on.
"""
from .fold_cache_write import fold_cache_writes
from .fold_casts import fold_casts
from .fold_combine import fold_combine
from .fold_kv_append import fold_kv_append
from .fold_rope import fold_rope
from .fuse_fp8_quant import fuse_fp8_quant, fuse_index_quant
from .fuse_gemv import fuse_gemv_chains
from .fusion import fuse_events
from .gemv_groups import size_gemv_groups
from .linearize import linearize
from .normalize import normalize
from .schedule import Schedule, schedule
from .split_kv import split_kv

__all__ = ["split_kv", "fuse_gemv_chains", "fuse_fp8_quant", "fuse_index_quant", "fold_casts", "fold_cache_writes", "fold_rope",
           "fold_kv_append", "fold_combine", "size_gemv_groups", "fuse_events", "normalize", "linearize", "schedule", "Schedule"]
