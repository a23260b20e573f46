"""The CUDA executor: builds the plan's persistent kernel and launches it per step.

The generated library is loaded with ctypes through a plain C ABI; the launch goes on
``torch.cuda.current_stream()``. The instruction queues live on the device once; the
operand table is re-bound per call (new input tensors or a new decode position change
data, never code). Event counters are monotonic across steps (epoch-based targets).
"""
from __future__ import annotations

import ctypes

import torch

from . import codegen
from . import ops as opreg
from .errors import TilecError
from .ops import attention as _attention  # noqa: F401
from .ops.linear_fused import staged_bytes
from .plan import KernelPlan

# dynamic shared memory per CTA: 227 KiB on Hopper less the executor's static shared memory
MAX_DYNAMIC_SMEM = 227 * 1024 - 2048
GEMV_RING_BYTES = 6 * 32768 + 512  # bulk-copy weight stages of a GEMV tile (ops.cuh kTmaStageBytes)
_ERR_INTS = 10  # ErrorRecord: 6 int32 + 2 int64


class WatchdogError(TilecError):
    """A device wait exceeded the watchdog bound; names the worker, instruction, event, op and FX node."""


class CudaExecutor:
    """Runs a :class:`KernelPlan` as one cooperative launch of W worker CTAs per step.

    Raises:
        TilecError: nvcc/ABI problems, or the W workers cannot be co-resident.
    """

    def __init__(self, plan: KernelPlan, opts, device: torch.device, progress=None, lib_path=None):
        """``lib_path``: an already built library of this plan (e.g. an artifact's ``cuda/libtilec.so``);
        without it the plan's sources are rendered and built (cached) with nvcc."""
        self.plan, self.opts, self.device = plan, opts, device
        self.sources = codegen.render(plan)
        self.lib_path = lib_path if lib_path is not None else codegen.build(self.sources, opts.arch, progress)
        lib = ctypes.CDLL(str(self.lib_path))
        if lib.tilec_abi_version() != codegen.ABI_VERSION:
            raise TilecError(f"{self.lib_path}: ABI version {lib.tilec_abi_version()} != {codegen.ABI_VERSION}")
        lib.tilec_launch.restype = ctypes.c_int
        lib.tilec_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
        lib.tilec_last_error.restype = ctypes.c_char_p
        self.lib = lib
        self.queues = plan.queues.to(device)
        self.counters = torch.zeros(max(plan.events.shape[0], 1), dtype=torch.int64, device=device)
        self.err = torch.zeros(_ERR_INTS, dtype=torch.int32, device=device)
        self.table = torch.zeros_like(plan.static_operands, device=device)
        self._last_table: torch.Tensor | None = None
        self.epoch = 0
        self.smem_bytes = self._smem_bytes()
        # per-instruction %globaltimer stamps [W, L, 2] (ns) when Options.profile is on
        self.stamps = (torch.zeros(*plan.queues.shape[:2], 2, dtype=torch.int64, device=device)
                       if getattr(opts, "profile", False) else None)

    def _smem_bytes(self) -> int:
        """Dynamic shared memory per CTA: attention scores and P.V partials (runtime/tilec/ops.cuh,
        ``op_attention``), the staged x rows of a GEMV tile when they fit in 96 KiB and its ring
        of weight stages, and what ops state themselves (``OpDef.smem_bytes``)."""
        need = 4096
        for op in self.plan.graph.ops:
            if op.kind == "attention":
                q, k, v = op.inputs
                if q.shape[3] > 256 or v.shape[3] > 256:
                    raise TilecError(f"op {op.name}: attention head dim {q.shape[3]}/{v.shape[3]} > 256")
                need = max(need, 4 * (4 * 256 + 4 + 8 * 4 * 256 + 4 * k.shape[2]) + 256)
            elif op.kind in ("linear", "linear_fused"):
                rows = 1
                for s in op.outputs[0].shape[:-1]:
                    rows *= s
                # staged rows, plus a ring of up to 6 x 32 KiB bulk-copy stages for the weights
                # (runtime/tilec/ops.cuh, gemv_bf16_tma; fewer stages when less is left)
                staged = staged_bytes(rows, op.inputs[0].shape[-1])
                if op.kind == "linear_fused" or staged <= 96 * 1024:
                    need = max(need, min(staged + GEMV_RING_BYTES, MAX_DYNAMIC_SMEM))
        for op in self.plan.graph.ops:  # ops that state their own needs (tilec/ops/*.py smem_bytes)
            need = max(need, opreg.opdef(op.kind).smem_bytes(op))
        if need > MAX_DYNAMIC_SMEM:
            raise TilecError(f"the plan needs {need} bytes of shared memory per CTA (max 227 KiB); "
                             f"a smaller attn_kv_chunk splits long attention caches")
        return (need + 127) // 128 * 128

    def reset(self) -> None:
        """Zeroes the event counters and the error record (after an aborted step)."""
        torch.cuda.synchronize(self.device)
        self.counters.zero_()
        self.err.zero_()
        self.epoch = 0

    def run(self, tensors: dict[str, torch.Tensor], operand_table: torch.Tensor, queues: torch.Tensor | None = None,
            check: bool | None = None, position: int = 0) -> None:
        """Launches one step at decode position ``position`` (the device adds ``position *
        pos_step`` to each operand entry); with ``check`` synchronizes and raises
        :class:`WatchdogError` on a timeout. The operand table is uploaded only when it is a
        different table from the last call's (a ``CompiledProgram`` passes the same table object
        for the same argument tensors)."""
        if self._last_table is not operand_table and (
                self._last_table is None or not torch.equal(self._last_table, operand_table)):
            self.table.copy_(operand_table)
            self._last_table = operand_table
        q = self.queues if queues is None else queues.to(self.device)
        self.epoch += 1
        stream = torch.cuda.current_stream(self.device).cuda_stream
        rc = self.lib.tilec_launch(q.data_ptr(), q.shape[0], q.shape[1], self.table.data_ptr(),
                                   self.counters.data_ptr(), self.epoch, self.err.data_ptr(),
                                   int(self.opts.watchdog_ms) * 1_000_000, self.smem_bytes, stream,
                                   None if self.stamps is None or queues is not None else self.stamps.data_ptr(),
                                   int(position))
        if rc != 0:
            raise TilecError(f"tilec launch failed: {self.lib.tilec_last_error().decode()}")
        if self.opts.check if check is None else check:
            self.check()

    def check(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        rec = self.err.cpu()
        if int(rec[0]) == 0:
            return
        worker, instr, event, task, op = (int(x) for x in rec[1:6])
        seen, target = (int(x) for x in rec[6:10].view(torch.int64))
        self.reset()
        name = self.plan.op_names[op] if 0 <= op < len(self.plan.op_names) else "empty task"
        prov = ""
        if 0 <= op < len(self.plan.graph.ops) and self.plan.graph.ops[op].provenance:
            prov = f" from FX node {self.plan.graph.ops[op].provenance.render()}"
        raise WatchdogError(f"watchdog: worker {worker} instruction {instr} (task {task}, op {name}{prov}) waited "
                            f"over {self.opts.watchdog_ms} ms on event {event}: counter {seen}, target {target}")
