"""The CUDA executor: builds the plan's persistent kernel and launches it per step.

The generated library is loaded with ctypes through a plain C ABI; the launch goes on
``torch.cuda.current_stream()``. The instruction queues live on the device once; the
operand table is re-bound per call (new input tensors or a new decode position change
data, never code). Event counters are monotonic across steps (epoch-based targets).
"""
from __future__ import annotations

import copy
import ctypes

import torch

from . import codegen
from . import smem
from .errors import TilecError
from .plan import KernelPlan

_ERR_INTS = 20  # ErrorRecord (runtime/tilec/common.cuh): 6 int32, 2 int64, 4 int32, 3 int64


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
        self.input_labels: dict[str, str] = {}  # buffer name -> its argument's label, for errors (CompiledProgram's)
        self.sources = codegen.render(plan)
        self.lib_path = lib_path if lib_path is not None else codegen.build(self.sources, opts.arch, progress)
        lib = ctypes.CDLL(str(self.lib_path))
        if lib.tilec_abi_version() != codegen.ABI_VERSION:
            raise TilecError(f"{self.lib_path}: ABI version {lib.tilec_abi_version()} != {codegen.ABI_VERSION}")
        lib.tilec_launch.restype = ctypes.c_int
        lib.tilec_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
        lib.tilec_last_error.restype = ctypes.c_char_p
        self.lib = lib
        self.queues = plan.queues.to(device)
        # the event counters, then the plan's arrival counters (tilec.plan)
        self.counters = torch.zeros(max(plan.events.shape[0] + plan.arrivals, 1), dtype=torch.int64, device=device)
        self.err = torch.zeros(_ERR_INTS, dtype=torch.int32, device=device)
        # [steps completed, CTAs finished]: the device advances the epoch (CUDA-graph replays too)
        self.state = torch.zeros(2, dtype=torch.int64, device=device)
        self.table = torch.zeros_like(plan.static_operands, device=device)
        self._last_table: torch.Tensor | None = None
        # dynamic shared memory per CTA: the GEMV weight ring, then the ops' scratch (tilec.smem)
        self.ring_stages = plan.ring_stages
        self.smem_bytes = plan.ring_stages * smem.STAGE_BYTES + smem.scratch_bytes(plan.graph)
        if self.smem_bytes > smem.MAX_DYNAMIC_SMEM:
            raise TilecError(f"the plan's weight ring ({plan.ring_stages} stages) and scratch need {self.smem_bytes} "
                             f"bytes of shared memory per CTA (max {smem.MAX_DYNAMIC_SMEM})")
        if getattr(opts, "ring_stages", None) is not None and plan.ring_stages:
            self.use_ring_stages(opts.ring_stages)  # Options.ring_stages: a depth chosen by the caller
        # per-instruction %globaltimer stamps [W, L, 4] (ns) when Options.profile is on: start (its
        # wait satisfied), end, and two op-defined marks (0 where the op sets none)
        self.stamps = (torch.zeros(*plan.queues.shape[:2], 4, dtype=torch.int64, device=device)
                       if getattr(opts, "profile", False) else None)
        # check="deferred": each step's error record is copied to pinned host memory behind it and read
        # once that copy has completed (an event), at a later call
        self._err_host: torch.Tensor | None = None
        self._err_copied: torch.cuda.Event | None = None

    def __deepcopy__(self, memo) -> "CudaExecutor":
        """The executor of a ``copy.deepcopy`` of a step: the same loaded library (code only; ctypes cannot copy
        it), and its own counters, epoch, error record and operand table, copied as they stand on the current
        stream, so that the copy goes on from where this executor is. A check this executor has queued
        (``check="deferred"``) stays with it."""
        new = object.__new__(CudaExecutor)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name == "lib":
                new.lib = value
            elif name in ("_err_host", "_err_copied", "_last_table"):
                setattr(new, name, None)  # (no record queued; the next call uploads its operand table)
            else:
                setattr(new, name, copy.deepcopy(value, memo))
        return new

    def __reduce__(self):
        """Refuses pickling with a clear error: the executor's loaded library (ctypes) and device buffers belong to
        this process (pickle raised ctypes' "objects containing pointers cannot be pickled").

        Raises:
            TilecError: always, saying what works instead.
        """
        raise TilecError("a step or program on the CUDA executor cannot be pickled: its loaded library and device "
                         "buffers belong to this process. Within the process use copy.deepcopy; to keep a compile, "
                         "save an artifact (`tilec compile`, tilec.artifact.save) and load it; or pickle a program "
                         "compiled with options executor=\"reference\"")

    def use_ring_stages(self, n: int) -> None:
        """Launches from now on with an ``n``-stage weight ring (2..8; the plan's stream words and
        scratch do not depend on it): for measuring the ring depth without recompiling.

        Raises:
            TilecError: ``n`` is outside 2..8, the plan streams nothing, or the ring and the
                scratch would not fit a CTA's shared memory.
        """
        if self.plan.ring_stages == 0 or not 2 <= n <= 8:
            raise TilecError(f"ring stages {n}: must be 2..8, for a plan that streams weights")
        nbytes = n * smem.STAGE_BYTES + smem.scratch_bytes(self.plan.graph)
        if nbytes > smem.MAX_DYNAMIC_SMEM:
            raise TilecError(f"{n} ring stages and scratch need {nbytes} bytes of shared memory per CTA "
                             f"(max {smem.MAX_DYNAMIC_SMEM})")
        self.ring_stages, self.smem_bytes = n, nbytes

    def reset(self) -> None:
        """Zeroes the event and arrival counters and the error record (after an aborted step)."""
        torch.cuda.synchronize(self.device)
        self._err_copied = None  # a queued record is of the steps this clears
        self.counters.zero_()
        self.state.zero_()
        self.err.zero_()

    def run(self, tensors: dict[str, torch.Tensor], operand_table: torch.Tensor, queues: torch.Tensor | None = None,
            check: bool | str | None = None, position: int = 0) -> None:
        """Launches one step at decode position ``position`` (the device adds ``position *
        pos_step`` to each operand entry). ``check`` (default: the options'): True synchronizes
        after the step and raises what it recorded (:meth:`check`); ``"deferred"`` first raises
        what an earlier step recorded if its record has reached the host (:meth:`check_deferred`),
        then launches and queues this step's record for a later call, without waiting for the step;
        False checks nothing. The operand table is uploaded only when it is a different table from
        the last call's (a ``CompiledProgram`` passes the same table object for the same argument
        tensors).

        Raises:
            WatchdogError, TilecError: as :meth:`check`, for this step (True) or an earlier one
                (``"deferred"``); TilecError: the launch failed.
        """
        mode = self.opts.check if check is None else check
        if mode is True and torch.cuda.is_current_stream_capturing():  # (its synchronize: an obscure CUDA error)
            raise TilecError("a step compiled with check=True synchronizes after each call, which a CUDA graph "
                             "capture does not allow: compile with options check=False or check=\"deferred\" to "
                             "capture it")
        if mode == "deferred":
            self.check_deferred()
        if self._last_table is not operand_table and (
                self._last_table is None or not torch.equal(self._last_table, operand_table)):
            self.table.copy_(operand_table)
            self._last_table = operand_table
        q = self.queues if queues is None else queues.to(self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        rc = self.lib.tilec_launch(q.data_ptr(), q.shape[0], q.shape[1], self.table.data_ptr(),
                                   self.counters.data_ptr(), self.state.data_ptr(), self.err.data_ptr(),
                                   int(self.opts.watchdog_ms) * 1_000_000, self.smem_bytes, self.ring_stages,
                                   stream,
                                   None if self.stamps is None or queues is not None else self.stamps.data_ptr(),
                                   int(position))
        if rc != 0:
            raise TilecError(f"tilec launch failed: {self.lib.tilec_last_error().decode()}")
        if mode == "deferred":
            if self._err_host is None:  # a normal tensor also when this first call is in inference mode
                with torch.inference_mode(False):
                    self._err_host = torch.zeros(_ERR_INTS, dtype=torch.int32).pin_memory()
            self._err_host.copy_(self.err, non_blocking=True)  # behind the step, on its stream
            self._err_copied = torch.cuda.Event()
            self._err_copied.record(torch.cuda.current_stream(self.device))  # the step's device, maybe not current
        elif mode:
            self.check()

    def _op_label(self, op: int) -> str:
        """Op ``op``'s name and, when known, the FX node it came from."""
        name = self.plan.op_names[op] if 0 <= op < len(self.plan.op_names) else "empty task"
        if 0 <= op < len(self.plan.graph.ops) and self.plan.graph.ops[op].provenance:
            name += f" from FX node {self.plan.graph.ops[op].provenance.render()}"
        labels = getattr(self, "input_labels", {})  # (set in __init__; an executor made otherwise has none)
        graph = self.plan.graph
        return name + (graph.ops[op].reads_text(labels, graph) if 0 <= op < len(graph.ops) else "")

    def check(self) -> None:
        """Synchronizes and raises what the steps since the last check recorded: a step that ended
        early (``WatchdogError``, or a ``TilecError`` for a plan / library mismatch; the executor's
        step state is reset), else the first index read at run time outside its range (a token id
        outside the embedding table, a cache slot outside the cache, a page id outside the key
        cache: ``TilecError`` naming the op; that step completed without the bad access)."""
        torch.cuda.current_stream(self.device).synchronize()
        self._err_copied = None  # read here, whole
        self._raise_recorded(self.err.cpu())

    def check_deferred(self, wait: bool = False) -> None:
        """Raises what the last ``check="deferred"`` step recorded (as :meth:`check`), once its record
        has reached the host: at once if its copy has completed, else only with ``wait`` (which
        synchronizes on that copy). A record not yet read stays queued; a later step's copy holds
        its errors too (the device keeps a record until the host clears it)."""
        done = self._err_copied
        if done is None or not (wait or done.query()):
            return
        done.synchronize()
        self._err_copied = None
        self._raise_recorded(self._err_host.clone(), "a step before this call (check=\"deferred\"): ")

    def _raise_recorded(self, rec: torch.Tensor, prefix: str = "") -> None:
        """Raises what the error record ``rec`` (int32 [_ERR_INTS], on the host) holds, its message
        after ``prefix``, clearing it on the device; returns when it holds nothing."""
        if int(rec[0]) == 0:
            if int(rec[10]):
                task, op = int(rec[11]), int(rec[12])
                index, lo, hi = (int(x) for x in rec[14:20].view(torch.int64))
                self.err[10:].zero_()
                raise TilecError(f"{prefix}task {task} (op {self._op_label(op)}) failed: index {index} read at "
                                 f"run time is outside [{lo}, {hi}) (the step completed without that access: "
                                 f"what depends on it is not valid)")
            return
        if int(rec[0]) == 3:
            worker, op = int(rec[1]), int(rec[5])
            self.reset()
            raise TilecError(f"{prefix}worker {worker} met an instruction of op {self._op_label(op)} whose "
                             f"dispatch signature this library holds no instance for (a tilec bug: plan and "
                             f"generated code disagree)")
        if int(rec[0]) == 2:
            self.reset()
            raise WatchdogError(f"{prefix}watchdog: a worker's GEMV weight stream stalled for over "
                                f"{self.opts.watchdog_ms} ms (its loader and compute warps disagree on the "
                                f"streamed tiles: a tilec bug)")
        worker, instr, event, task, op = (int(x) for x in rec[1:6])
        seen, target = (int(x) for x in rec[6:10].view(torch.int64))
        self.reset()
        raise WatchdogError(f"{prefix}watchdog: worker {worker} instruction {instr} (task {task}, op "
                            f"{self._op_label(op)}) waited over {self.opts.watchdog_ms} ms on event {event}: "
                            f"counter {seen}, target {target}")
