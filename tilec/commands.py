"""What the ``tilec`` command line's commands do (:mod:`tilec.cli` declares them and their options).

Each ``*_artifact`` function is one command's body; errors meant for the user are
:class:`tilec.cli.Failure` with the exit code of :mod:`tilec.cli`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect as pyinspect
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import click
import torch
import torch.utils._pytree as pytree

import tilec

from . import artifact as art_mod
from .artifact import ArtifactError, resolve_stage
from .cli import EXIT_COMPILE, EXIT_ERROR, EXIT_MISMATCH, EXIT_USAGE, Failure, Progress, stdout_to_devnull
from .capture import attribute_walk, set_attribute_tensor
from .codegen.build import cache_root, extra_flags, sha256_file
from .dump import ENV_VAR as DUMP_ENV_VAR, DumpError, check_dump_root, dump_root
from .errors import InputError, TilecError, describe_exception, with_article
from .frontend import const_name
from .ir import BufferKind
from .options import OPTION_TYPES, Options, did_you_mean
from .stages import OPGRAPH_STAGES, STAGES
from .timing import cuda_graph, step_times


EXPECTED_RETURN = ("expected (module, example_args) or (module, example_args, dict(positions=..., "
                   "max_positions=...)) with a torch.nn.Module and a tuple of example arguments")


# ---- compile -----------------------------------------------------------------------------

def compile_artifact(progress: Progress, factory: str, output: Path, option_pairs, force: bool, no_build: bool) -> None:
    """``tilec compile``: compiles FACTORY's module and writes the artifact at ``output``. ``-O dump_dir=none``
    turns dumps off over ``$TILEC_DUMP_DIR`` (the option wins; the variable is restored after)."""
    opts = parse_options(option_pairs)
    dumps_off = opts.dump_dir is None and any(p.partition("=")[0].strip() == "dump_dir" for p in option_pairs)
    env_dumps = os.environ.get(DUMP_ENV_VAR)
    if dumps_off:
        env = _with_env(DUMP_ENV_VAR, None)
    elif opts.dump_dir is None and env_dumps and not Path(env_dumps).expanduser().is_absolute():
        # where it is now, whatever directory the factory moves to; messages still name the variable
        env = _with_env(DUMP_ENV_VAR, str(Path(env_dumps).expanduser().absolute()))
    else:
        env = contextlib.nullcontext()
    with env:
        _compile_artifact(progress, factory, output, opts, force, no_build)


@contextlib.contextmanager
def _with_env(name: str, value: str | None):
    """The environment with variable ``name`` set to ``value`` (None: unset) inside the block; its old
    value is put back after."""
    saved = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def _compile_artifact(progress: Progress, factory: str, output: Path, opts: Options, force: bool,
                      no_build: bool) -> None:
    from .api import compile_module

    try:  # a bad output path, dump directory or build environment fails before a long compile
        art_mod.check_target(output, force)
        target = output.absolute()  # (the factory may change directory)
        dumps = dump_root(opts)
        if dumps is not None and (dumps.resolve() == output.resolve() or output.resolve() in dumps.resolve().parents):
            raise TilecError(f"the dump directory {dumps} is inside the artifact's output {output}: an artifact "
                             f"holds only what tilec writes there; dump elsewhere")
        check_dump_root(opts)
        if dumps is not None and not dumps.is_absolute():  # where it is now, whatever directory the factory moves to
            opts = dataclasses.replace(opts, dump_dir=str(dumps.absolute()))
        nvcc = os.environ.get("TILEC_NVCC")
        if not no_build and nvcc and art_mod._nvcc_version() is None:
            raise TilecError(f"TILEC_NVCC={nvcc} does not run as nvcc (unset it, or use --no-build)")
        if not no_build and art_mod._nvcc_version() is not None:
            extra_flags()
            cache_root()
    except (ArtifactError, TilecError) as e:
        raise Failure(str(e)) from e
    if opts.executor == "cuda" and not torch.cuda.is_available():
        raise Failure("option executor=cuda needs a CUDA GPU, and torch sees none")
    with progress.step(f"importing {factory}"):
        fn, info = load_factory(factory)
    with progress.step(f"calling {info['name']}()"):
        module, args, positions, max_positions = call_factory(fn, factory)
    sources = model_sources(module, info["file"] or getattr(sys.modules.get(info["module"] or ""), "__file__", None))
    if sources:  # (absent where there are none: the manifests of earlier versions read the same)
        info["model_sources"] = sources
    snapshot = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]

    def hook(stage: str, ir, seconds: float) -> None:
        if seconds >= 1.0:  # the opgraph stage's time includes torch.export and the lowering
            progress(f"  stage {stage}{' (torch.export, lowering)' if stage == 'opgraph' else ''}: {seconds:.1f} s")

    with progress.step("compiling (torch.export, lowering, passes, encoding)"):
        try:
            program = compile_module(module, tuple(args), positions=positions, max_positions=max_positions,
                                     options=opts, hook=hook)
        except InputError as e:  # its example arguments, positions or max_positions do not fit the module
            raise Failure(f"bad input from {_defined_at(fn, factory)}: {e}") from e
        except DumpError as e:  # the dump directory filled up or went away during the compile: bad input (2)
            raise Failure(str(e)) from e
        except TilecError as e:
            raise Failure(f"compile failed: {e}", EXIT_COMPILE) from e
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # also sys.exit() and a user's own BaseException subclasses
            raise Failure(f"compile failed: {describe_exception(e)}", EXIT_COMPILE) from e
    with progress.step(f"writing {output}" + ("" if no_build else " (nvcc when present)")):
        try:
            art_mod.save(target, program, snapshot, factory=info, positions=positions, max_positions=max_positions,
                         param_sources=_param_sources(module, program), build=not no_build, force=force,
                         progress=progress)
        except ArtifactError as e:
            raise Failure(str(e)) from e
        except TilecError as e:
            raise Failure(f"compile failed: {e}", EXIT_COMPILE) from e
    s = program.stats
    lib = (target / art_mod.LIBRARY).exists()
    try:
        click.echo(f"wrote {output}: {s['ops']} ops, {s['tasks']} tasks, {s['events']} events on "
                   f"{program.plan.workers} workers (cost-model makespan {s['predicted_step_us']} us: planning "
                   f"weights, not a timing); library "
                   f"{'cuda/libtilec.so (' + program.opts.arch + ')' if lib else 'not built'}")
    except OSError as e:  # `compile ... > file` on a full disk: the artifact is written, only its summary is lost
        if e.errno is None:
            raise
        stdout_to_devnull()
        click.echo(f"tilec: wrote {output}, but cannot write to standard output: {e.strerror or e}", err=True)




# Options of ``torch.compile(backend="tilec")`` and keys of a factory's dict, not compile options (the
# names of options.NOT_COMPILE_OPTIONS, told to a command-line user).
_FACTORY_KEY = "a key of the factory's returned dict (module, args, dict(positions=..., max_positions=...)), not a " \
               "compile option"
_NOT_CLI_OPTIONS = {"fallback": "an option of torch.compile(backend=\"tilec\") only: `tilec compile` reports "
                                "every unsupported node and writes nothing",
                    "max_positions": _FACTORY_KEY, "positions": _FACTORY_KEY}


def parse_options(pairs) -> Options:
    """``("workers=8", "tile_cols=none")`` -> Options; values parse as int, float, bool, none, else str.

    Raises :class:`Failure` naming the ``--option`` as typed (``workers=1e3``, not the parsed 1000.0)."""
    d, raw = {}, {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise Failure(f"--option {pair!r}: expected KEY=VALUE, e.g. --option workers=8")
        if key in _NOT_CLI_OPTIONS:
            raise Failure(f"--option {pair}: {key} is {_NOT_CLI_OPTIONS[key]}")
        if key in d:
            raise Failure(f"--option {pair}: {key} is given twice (the first: {key}={raw[key]})")
        # `-O workers=8,tile_n=64`: a second option after a comma, in a value that cannot hold one (a
        # string option's value - a dump directory - may)
        rest = value.split(",", 1)[1] if "," in value else ""
        first_type = OPTION_TYPES.get(key, "str").split("|")[0].strip()  # "bool | str" (check) is no string
        if first_type != "str" and rest.partition("=")[0].strip() in OPTION_TYPES:
            raise Failure(f"--option {pair}: one KEY=VALUE per -O (e.g. -O {key}={value.split(',')[0]} "
                          f"-O {value.split(',', 1)[1]})")
        d[key], raw[key] = _parse_value(value.strip()), value.strip()
        try:
            Options.from_dict({key: d[key]})  # each option's own checks, reported with the option as typed
        except (TypeError, ValueError) as e:
            msg = str(e).removeprefix(f"tilec option {key}={d[key]!r}: ")  # not the parsed value (1e3 -> 1000.0)
            raise Failure(f"--option {pair}: {msg}") from e
    try:
        return Options.from_dict(d)
    except (TypeError, ValueError) as e:
        raise Failure(str(e)) from e


def _parse_value(s: str):
    low = s.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def _source_sha256(path) -> str | None:
    """The sha256 (hex) of the factory module's file, or None when it has none or it cannot be read."""
    try:
        return sha256_file(Path(path)) if path else None
    except OSError:
        return None


def _installed_dirs() -> list[Path]:
    """Where installed code lives (the standard library, site-packages, torch's and tilec's own packages): its files
    are not the user's model sources (:func:`model_sources`)."""
    import site
    import sysconfig

    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", list)())
    dirs.add(getattr(site, "getusersitepackages", lambda: None)())
    dirs.update(os.path.dirname(m.__file__) for m in (torch, tilec))
    return [Path(d).resolve() for d in dirs if d]


def model_sources(module: torch.nn.Module, factory_file: str | None) -> dict[str, str]:
    """The user's files defining the classes of ``module`` and its submodules and their base classes (not the
    functions they call from other files), other than the factory's own file
    (``factory_file``, the factory module's: a decorated factory function's code is its decorator's, which
    recorded the factory's file here too) and installed code (:func:`_installed_dirs`): absolute path -> sha256. A
    factory that imports its model from a file of its own (``from mymodel import Net``) records that file, so
    ``run --check`` and ``bench`` warn of an edit to it too (the factory's ``source_sha256`` covers its own file)."""
    skip = {Path(factory_file).resolve()} if factory_file else set()
    installed = _installed_dirs()
    out = {}
    for cls in {c for m in module.modules() for c in type(m).__mro__}:  # (a base class's file too)
        try:
            path = Path(pyinspect.getfile(cls)).resolve()
        except (TypeError, OSError):  # a built-in class, or one of a module not in sys.modules (the factory file's)
            continue
        if path not in skip and path.is_file() and not any(path.is_relative_to(d) for d in installed):
            digest = _source_sha256(path)
            if digest:
                out[str(path)] = digest
    return dict(sorted(out.items()))


def load_factory(spec: str, cwd: str | None = None):
    """Imports ``MODULE:FACTORY``; returns ``(callable, info)`` with ``info`` as recorded in the manifest
    (``spec``, ``module``, ``file``, ``name``, ``cwd``, and ``source_sha256``: the module file's sha256, which
    ``run --check`` and ``bench`` compare to warn of a factory edited since the compile)."""
    mod_part, sep, name = spec.rpartition(":")
    if not sep or not mod_part or not name or mod_part.endswith(":"):
        raise Failure(f"factory {spec!r}: expected MODULE:FACTORY, e.g. examples/factories.py:tiny_llama_step "
                      f"or mypackage.models:make_step")
    cwd = cwd or os.getcwd()
    if mod_part.endswith(".py") or "/" in mod_part or os.sep in mod_part:
        file = Path(mod_part) if os.path.isabs(mod_part) else Path(cwd) / mod_part
        if not file.is_file():
            what = "is a directory, not a Python file" if file.is_dir() else "no such file"
            raise Failure(f"factory module {mod_part}: {what} ({file})")
        file = file.resolve()
        modname = "_tilec_factory_" + hashlib.sha256(str(file).encode()).hexdigest()[:12]
        spec_obj = importlib.util.spec_from_file_location(modname, file)
        if spec_obj is None:  # a suffix no loader claims (factory.txt, no suffix): read it as Python source
            loader = importlib.machinery.SourceFileLoader(modname, str(file))
            spec_obj = importlib.util.spec_from_file_location(modname, file, loader=loader)
        module = importlib.util.module_from_spec(spec_obj)
        if str(file.parent) not in sys.path:
            sys.path.insert(0, str(file.parent))
        try:
            spec_obj.loader.exec_module(module)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # also sys.exit() and a user's own BaseException subclasses
            raise Failure(f"importing factory module {file} failed: {describe_exception(e)}") from e
        info = {"spec": spec, "module": None, "file": str(file), "name": name, "cwd": cwd}
    else:
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(mod_part)
        except ModuleNotFoundError as e:
            if e.name and (mod_part == e.name or mod_part.startswith(e.name + ".")):
                raise Failure(f"cannot import factory module {mod_part!r}: no module named {e.name!r} (searched "
                              f"{cwd} and sys.path; a path to a .py file works too)") from e
            raise Failure(f"importing factory module {mod_part} failed: {e}") from e
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # also sys.exit() and a user's own BaseException subclasses
            raise Failure(f"importing factory module {mod_part} failed: {describe_exception(e)}") from e
        info = {"spec": spec, "module": mod_part, "file": None, "name": name, "cwd": cwd}
    info["source_sha256"] = _source_sha256(getattr(module, "__file__", None))
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if pyinspect.isfunction(v) and not n.startswith("_")
                         and v.__module__ == module.__name__)
        raise Failure(f"factory module {mod_part} has no {name!r}"
                      + (f"; functions defined there: {', '.join(defined)}" if defined else ""))
    if not callable(fn):
        raise Failure(f"{spec}: {name} is not a callable factory (it is of type {type(fn).__name__})")
    return fn, info


def call_factory(fn, spec: str):
    """Calls the factory and checks what it returns: ``(module, args, positions, max_positions)``.
    Raises :class:`Failure` (exit 2) naming the factory's file and line for anything else, and for a
    factory that raises or calls ``sys.exit``."""
    at = _defined_at(fn, spec)
    try:
        res = fn()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # also sys.exit() and a user's own BaseException subclasses
        raise Failure(f"factory {at} raised {describe_exception(e)}") from e
    if not isinstance(res, (tuple, list)) or len(res) not in (2, 3):
        raise Failure(f"factory {at} returned {_describe(res)}; {EXPECTED_RETURN}")
    module, args = res[0], res[1]
    extra = res[2] if len(res) == 3 else {}
    if not isinstance(module, torch.nn.Module):
        raise Failure(f"factory {at} returned {_describe(module)} as the module; {EXPECTED_RETURN}")
    if not isinstance(args, (tuple, list)):
        raise Failure(f"factory {at} returned {_describe(args)} as example_args; {EXPECTED_RETURN}"
                      + (" (wrap a single tensor as (x,))" if isinstance(args, torch.Tensor) else ""))
    for i, a in enumerate(args):
        if not (isinstance(a, torch.Tensor) or a is None or isinstance(a, (bool, int, float, str))):
            raise Failure(f"factory {at}: example argument {i} is {_describe(a)}; arguments must be tensors "
                          f"or plain numbers")
    from .api import meta_tensors

    meta = meta_tensors(module, args, "example argument")
    if meta:
        named = meta[0] if len(meta) == 1 else f"{', '.join(meta[:-1])} and {meta[-1]}" if len(meta) <= 3 else \
            f"{', '.join(meta[:3])} and {len(meta) - 3} more"
        raise Failure(f"factory {at}: {named} "
                      f"{'is a' if len(meta) == 1 else 'are'} meta-device tensor{'' if len(meta) == 1 else 's'} "
                      f"(no data): tilec needs real weights and inputs (load or initialize them, e.g. "
                      f"module.to_empty(device=...) and then the weights)")
    if not isinstance(extra, dict):
        raise Failure(f"factory {at} returned {_describe(extra)} as its third element; {EXPECTED_RETURN}")
    unknown = sorted(set(extra) - {"positions", "max_positions"}, key=str)
    if unknown:
        hint = did_you_mean(unknown, ["max_positions", "positions"])
        raise Failure(f"factory {at}: unknown key(s) {unknown} in its third element{hint}; valid keys: "
                      f"['max_positions', 'positions']")
    positions = extra.get("positions", ())
    if not isinstance(positions, (list, tuple)):
        raise Failure(f"factory {at}: positions={positions!r} must be a list of argument indices")
    positions = list(positions)
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(args):
            raise Failure(f"factory {at}: positions entry {p!r} is not an argument index "
                          + (f"(0..{len(args) - 1})" if args else "(the example arguments are empty)"))
        if not isinstance(args[p], torch.Tensor) or args[p].dtype not in (torch.int64, torch.int32):
            raise Failure(f"factory {at}: positions entry {p} must index an int64 or int32 tensor argument; "
                          f"argument {p} is {_describe(args[p])}")
    if len(set(positions)) != len(positions):
        raise Failure(f"factory {at}: positions {positions} lists an argument twice")
    max_positions = extra.get("max_positions", 1)
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise Failure(f"factory {at}: max_positions={max_positions!r} must be an int >= 1")
    # the artifact keeps the example arguments as its run input (`tilec run --check`): their
    # position must be one the program plans for, the same in every position argument
    held = {p: args[p].reshape(-1)[0].item() for p in positions if args[p].numel() > 0}
    for p, v in held.items():
        if not 0 <= v < max_positions:
            raise Failure(f"factory {at}: argument {p} (a positions entry) holds position {v}, outside the planned "
                          f"range [0, {max_positions}) of max_positions={max_positions}"
                          + ("" if "max_positions" in extra else " (the default: give max_positions in the factory's "
                                                                   "third element)"))
    if len(set(held.values())) > 1:
        raise Failure(f"factory {at}: the position arguments disagree ({', '.join(f'argument {p} holds {v}' for p, v in held.items())}): "
                      f"each must hold the example's decode position")
    return module, tuple(args), positions, max_positions


def _defined_at(fn, spec: str) -> str:
    """``name() at FILE:LINE`` for a factory function, else ``spec`` (a callable without source)."""
    code = getattr(pyinspect.unwrap(fn), "__code__", None)
    return f"{fn.__name__}() at {code.co_filename}:{code.co_firstlineno}" if code else spec


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a Tensor {str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"{with_article(type(x).__name__)} of {len(x)} element(s)"
    return "None" if x is None else with_article(type(x).__name__)


def _param_sources(module: torch.nn.Module, program) -> dict[str, str]:
    """Parameter buffer name -> the module's state_dict key holding the same tensor."""
    by_key = {}
    for key, t in module.state_dict(keep_vars=True).items():
        by_key.setdefault((t.data_ptr(), tuple(t.shape), t.dtype), key)
    out = {}
    for name, b in program.graph.buffers.items():
        if b.kind is BufferKind.PARAM:
            t = program.tensors[name]
            key = by_key.get((t.data_ptr(), tuple(t.shape), t.dtype))
            if key is not None:
                out[name] = key
    return out


# ---- inspect -----------------------------------------------------------------------------

def inspect_artifact(progress: Progress, artifact_dir: Path, stage: str | None, fmt: str) -> None:
    """``tilec inspect``: prints the artifact's stages (or one) as text, JSON or DOT."""
    art = open_artifact(artifact_dir, check_version=False)
    if art.manifest["tilec"] != tilec.__version__:
        progress.warn(f"{artifact_dir} was built by tilec {art.manifest['tilec']} (this is {tilec.__version__})")
    try:
        stages = [resolve_stage(stage)] if stage is not None else list(STAGES)
    except ValueError as e:
        raise Failure(str(e)) from e
    try:  # every file read before anything is printed: a damaged artifact prints its error alone
        if fmt == "json":
            data = art.stage_json(stages[0]) if stage else {
                "manifest": art.manifest, "stages": {s: art.stage_json(s) for s in stages}}
            text = json.dumps(data, indent=1) + "\n"
        elif fmt == "dot":
            text = to_dot(art, stages[0] if stage else "plan")
        elif stage:
            text = art.stage_text(stages[0])
        else:
            text = _summary(art) + "\n" + "".join(f"\n=== {i:02d}-{s} ===\n" + art.stage_text(s)
                                                 for i, s in enumerate(stages, 1))
    except ArtifactError as e:  # a file missing, corrupt or not the manifest's: bad input (2), as run and bench
        raise Failure(str(e)) from e
    click.echo(text, nl=False)


def _summary(art) -> str:
    m = art.manifest
    f = m.get("factory") or {}
    lib = m["cuda"]["library"] or f"none ({m['cuda']['note'] or 'not built'})"
    lines = [f"artifact {art.path}",
             f"  built by  tilec {m['tilec']}, torch {m['torch']}, transformers {m['transformers']}, nvcc {m['nvcc']}",
             f"  created   {m['created']} on {m['device']}",
             f"  factory   {f.get('spec')}",
             f"  target    {m['arch']}, library {lib}",
             "  options   " + " ".join(f"{k}={v}" for k, v in m["options"].items()),
             "  stats     " + " ".join(f"{k}={v}" for k, v in m["stats"].items())]
    return "\n".join(lines)


def _q(s) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(art, stage: str) -> str:
    """Graphviz DOT text: the op/buffer graph for the OpGraph stages (``opgraph`` .. ``gemv_groups``); otherwise the
    task/event graph of the stage (for ``schedule`` and ``plan``: the linearized graph with one
    cluster per worker)."""
    lines = [f"digraph {_q('tilec ' + stage)} {{", "  rankdir=TB;", "  node [fontname=monospace, fontsize=10];"]
    if stage in OPGRAPH_STAGES:
        g = art.stage_json(stage)
        colors = {"input": "lightblue", "param": "lightyellow", "const": "lightgrey", "table": "lightgrey",
                  "state": "orange", "temp": "white", "output": "palegreen"}
        for b in g["buffers"]:
            label = f"{b['name']}\n{b['dtype']}[{'x'.join(map(str, b['shape']))}] {b['kind']}"
            lines.append(f"  {_q('buf:' + b['name'])} [shape=ellipse, style=filled, "
                         f"fillcolor={colors.get(b['kind'], 'white')}, label={_q(label)}];")
        for op in g["ops"]:
            lines.append(f"  {_q('op:' + op['name'])} [shape=box, label={_q(op['name'] + chr(10) + op['kind'])}];")
            for v in op["inputs"]:
                lines.append(f"  {_q('buf:' + v['buffer'])} -> {_q('op:' + op['name'])};")
            for v in op["outputs"]:
                lines.append(f"  {_q('op:' + op['name'])} -> {_q('buf:' + v['buffer'])};")
    else:
        tg = art.stage_json(stage if stage not in ("schedule", "plan") else "linearized")
        labels = {t["id"]: t["label"] for t in tg["tasks"]}
        if stage in ("schedule", "plan"):
            sched = art.stage_json("schedule")
            for w, q in enumerate(sched["queues"]):
                if q:
                    lines.append(f"  subgraph cluster_w{w} {{ label={_q(f'worker {w}')};")
                    for entry in q:
                        label = f"#{entry['index']} {labels[entry['task']]}"
                        lines.append(f"    t{entry['task']} [shape=box, label={_q(label)}];")
                    lines.append("  }")
        else:
            lines += [f"  t{t['id']} [shape=box, label={_q(t['label'])}];" for t in tg["tasks"]]
        for e in tg["events"]:
            eid = e["id"]
            lines.append(f"  e{eid} [shape=diamond, label={_q(f'e{eid} ' + e['strategy'])}];")
            lines += [f"  t{p} -> e{eid};" for p in e["preds"]]
            lines += [f"  e{eid} -> t{s};" for s in e["succs"]]
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---- run ---------------------------------------------------------------------------------

def run_artifact(progress: Progress, artifact_dir: Path, executor: str | None, check: bool, tol: float | None) -> None:
    """``tilec run``: one step on the artifact's stored inputs, optionally checked against eager."""
    if tol is not None and not check:  # a tolerance with nothing to compare against: say so, don't ignore it
        raise click.UsageError("--tol is the tolerance of --check; pass --check too")
    if tol is not None and not math.isfinite(tol):  # FloatRange lets nan and inf through
        raise click.BadParameter(f"{tol} is not a finite number", param_hint="'--tol'")
    art = open_artifact(artifact_dir)
    program = build_program(art, executor, progress)
    args = art.inputs(program.device)
    with progress.step(f"running one step ({program.executor_kind} executor)"):
        t0 = time.perf_counter()
        outs = _run_step(program, args)
        dt = time.perf_counter() - t0
    click.echo(f"ran {art.path} on the {program.executor_kind} executor ({program.device}) in {dt * 1e3:.1f} ms")
    for i, t in enumerate(outs):
        tf = t.detach().float()
        finite = bool(torch.isfinite(tf).all())
        click.echo(f"  output {i}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)} "
                   f"mean {tf.mean().item():.4g} std {tf.std().item() if tf.numel() > 1 else 0.0:.4g}"
                   f"{'' if finite else ' (NOT FINITE)'}")
    if not check:
        return
    module, device, folded = eager_reference(art, progress)
    eager_args = art.inputs(device)
    with progress.step("running eager PyTorch"), torch.no_grad():
        try:
            want = module(*eager_args)
        except Exception as e:
            raise Failure(f"eager PyTorch raised {type(e).__name__}: {e}", EXIT_ERROR) from e
    # a dict or nested outputs compare leaf by leaf, labelled by their keys (output ['y'])
    paths, _ = pytree.tree_flatten_with_path(want)
    plain = isinstance(want, (torch.Tensor, tuple, list))
    labels = [f"output {i}" if plain else f"output {pytree.keystr(path)}" for i, (path, _) in enumerate(paths)]
    want = [w for _, w in paths]
    rows = [(label, g, w) for label, g, w in zip(labels, outs, want)]
    if len(outs) != len(want):
        raise Failure(f"the artifact returns {len(outs)} output(s), eager returns {len(want)}", EXIT_MISMATCH)
    for i, name in enumerate(program.graph.inputs):  # state updated in place (KV caches)
        b = program.graph.buffers.get(name)
        if b is not None and b.kind is BufferKind.STATE:
            rows.append((f"state arg {i} ({_param_label(module, i, name)})", args[i], eager_args[i]))
    for i, _ in program.graph.position_updates:  # position counters the step advances in place
        if isinstance(args[i], torch.Tensor) and isinstance(eager_args[i], torch.Tensor):
            rows.append((f"counter arg {i} ({_param_label(module, i, str(program.graph.inputs[i]))})", args[i],
                         eager_args[i]))
    if tol is None:
        tol = 1e-4 if all(w.dtype in (torch.float32, torch.float64) for _, _, w in rows
                          if w.is_floating_point()) else 2e-2
    errors, oks = [], []
    click.echo(f"check against eager (relative L2, tolerance {tol:.0e}; integer tensors must be equal):")
    for label, got, ref in rows:
        err = rel_l2(got, ref)
        # integer tensors (token ids, position counters) are exact: a relative tolerance would let a counter
        # of 1000 pass at 1001
        ok_row = err <= tol if ref.is_floating_point() else (
            got.shape == ref.shape and torch.equal(got.detach().cpu(), ref.detach().cpu()))
        errors.append(err)
        oks.append(ok_row)
        why = ""
        if got.shape != ref.shape:
            why = f" (tilec returned {str(got.dtype).removeprefix('torch.')}{list(got.shape)})"
        elif math.isnan(err):
            why = f" ({_nonfinite_why(got, ref)})"
        elif not ok_row and ref.numel() == 1:  # an integer scalar (a position counter): show both values
            why = f" (tilec {got.item()}, eager {ref.item()})"
        elif ref.numel() and not torch.isfinite(ref.detach().cpu().double()).any():
            why = " (no finite values to compare: the NaN / infinite values match)"
        shown = f"{err:.3e}" if got.shape == ref.shape else "n/a".ljust(9)  # no L2 between two shapes
        click.echo(f"  {label:<32} {str(ref.dtype).removeprefix('torch.')}{list(ref.shape)}  {shown}  "
                   f"{'ok' if ok_row else 'MISMATCH'}{why}")
    ok = all(oks)  # NaN (not finite, wrong shape) fails
    shaped = [label.strip() for label, got, ref in rows if got.shape != ref.shape]
    errors = [e for e, (_, got, ref) in zip(errors, rows) if got.shape == ref.shape]
    worst = float("nan") if any(math.isnan(e) for e in errors) else max(errors, default=0.0)
    differ = [label.strip() for (label, got, ref), row_ok in zip(rows, oks)
              if not row_ok and not ref.is_floating_point() and got.shape == ref.shape]
    click.echo(f"{'PASS' if ok else 'FAIL'}: " + (f"shapes differ ({', '.join(shaped)}); " if shaped else "")
               + (f"integer values differ ({', '.join(differ)}); " if differ else "")
               + (f"worst relative L2 {worst:.3e} (tolerance {tol:.0e})" if errors else "nothing of eager's shapes "
                  "to compare"))
    if not ok:
        if folded:
            names = ", ".join(folded[:4]) + (", ..." if len(folded) > 4 else "")
            limits = art.manifest.get("state_limits")
            known = isinstance(limits, list) and len(limits) == 2 and all(type(n) is int for n in limits)
            why = (f"each larger than {limits[0] >> 20} MiB, past {limits[1] >> 20} MiB in all with the smaller "
                   f"ones it stores, or of a dtype safetensors cannot store" if known
                   else "the artifact was written by a tilec that did not store them")
            click.echo(f"note: the artifact does not store module buffer(s) or tensor attribute(s) {names} (the "
                       f"plan folded them into other values, or does not read them; {why}), so eager uses the "
                       f"factory's own values for them: a factory that draws them at random (unseeded) fails this "
                       f"check", err=True)
        raise click.exceptions.Exit(EXIT_MISMATCH)


def _param_label(module, i: int, fallback: str) -> str:
    """The name of positional argument ``i`` of ``module.forward`` as its signature spells it
    (``past_key``; ``state[1]`` for the second value of ``*state``), else ``fallback`` (the graph's
    input name)."""
    try:
        params = list(pyinspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return fallback
    for j, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            return f"{p.name}[{i - j}]"
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if j == i:
            return p.name
    return fallback


def _nonfinite_why(got: torch.Tensor, ref: torch.Tensor) -> str:
    """Why :func:`rel_l2` of two tensors of one shape is NaN: whose NaN / infinite values the other lacks."""
    a, e = torch.isfinite(got.detach().cpu()), torch.isfinite(ref.detach().cpu())
    extra_tilec, extra_eager = bool((~a & e).any()), bool((a & ~e).any())
    if extra_tilec and not extra_eager:
        return "tilec has NaN or infinite values where eager has not"
    if extra_eager and not extra_tilec:
        return "eager has NaN or infinite values where tilec has not"
    return "their NaN and infinite values differ"


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``|got - ref| / |ref|`` in float64 on the CPU over the finite elements (``|got - ref|`` when ``ref``
    is all zeros there); NaN if shapes differ or ``got`` has a NaN or an infinity where ``ref`` has not the
    same (eager's own NaNs, matched by tilec's, are not a mismatch)."""
    a, e = got.detach().cpu().double(), ref.detach().cpu().double()
    if a.shape != e.shape:
        return float("nan")
    finite = torch.isfinite(a)
    if not finite.all():
        if not (torch.equal(finite, torch.isfinite(e)) and torch.equal(a.isnan(), e.isnan())
                and torch.equal(a.isposinf(), e.isposinf())):
            return float("nan")
        a, e = a[finite], e[finite]
    norm = e.norm()
    return float((a - e).norm() / norm) if norm > 0 else float((a - e).norm())


def _run_step(program, args) -> list[torch.Tensor]:
    try:
        out = program(*args)
        if program.device.type == "cuda":
            torch.cuda.synchronize(program.device)
            program.check_errors()  # a plan compiled with check="deferred" raises its step's errors here
    except TilecError as e:
        raise Failure(f"the step failed: {e}", EXIT_ERROR) from e
    return pytree.tree_leaves(out)


def open_artifact(path: Path, check_version: bool = True):
    with click.get_current_context().obj.step(f"verifying {path}"):
        try:
            return art_mod.load(path, check_version=check_version)
        except ArtifactError as e:
            raise Failure(str(e)) from e


def build_program(art, executor: str | None, progress: Progress):
    with progress.step("loading the plan"):
        try:
            return art.program(executor, progress)
        except ArtifactError as e:
            raise Failure(str(e)) from e
        except TilecError as e:
            code = EXIT_USAGE if executor == "cuda" and art_mod.gpu_arch() is None else EXIT_ERROR
            raise Failure(str(e), code) from e


def _replace_state(module: torch.nn.Module, buffers: dict[str, torch.Tensor], attributes: dict[str, tuple],
                   old: torch.Tensor, new: torch.Tensor) -> None:
    """Sets every buffer and plain tensor attribute of ``module`` that is ``old`` (by identity: ``self.scale =
    self.l.scale`` keeps the two one tensor; ``buffers`` by name with duplicates, ``attributes`` name -> (tensor,
    path) of :func:`tilec.capture.attribute_walk`) to ``new``. For what ``copy_``
    refuses to write: an expanded view, an inference tensor."""
    for path, value in buffers.items():
        if value is old:
            owner, _, name = path.rpartition(".")
            module.get_submodule(owner)._buffers[name] = new
    for value, path in attributes.values():
        if value is old:
            set_attribute_tensor(module, path, new)


def eager_reference(art, progress: Progress):
    """The factory's module with the artifact's weights loaded, and the module buffers and plain tensor attributes it
    kept as constants:
    ``(module, device of its inputs, the module's names of the buffers the plan folded into other values and the
    artifact does not store)`` - for those eager has only the factory's own values; none are named when the
    factory's file (or a model source the manifest records, :func:`model_sources`) was edited since the compile (a
    warning says so, and a failed check would otherwise blame those buffers)."""
    f = art.factory
    if not f:
        raise Failure(f"{art.path} records no factory: cannot build the eager reference")
    spec = f"{f['file']}:{f['name']}" if f.get("file") else f["spec"]
    with progress.step(f"rebuilding the eager module ({f['spec']})"):
        try:
            fn, now = load_factory(spec, f.get("cwd"))
        except Failure as e:  # moved or deleted since the compile: say where the check looks and why
            where = f.get("cwd") or "an unrecorded directory"
            raise Failure(f"{e}; the eager reference (run --check, bench) calls the factory the artifact's manifest "
                          f"records ({f['spec']}, compiled in {where})", e.exit_code) from e
        module, _, _, _ = call_factory(fn, f["spec"])
    changed = [f"the factory's module ({now['file'] or now['module']})"] if (
        f.get("source_sha256") and now["source_sha256"] and now["source_sha256"] != f["source_sha256"]) else []
    changed += [f"the module's source {path}" for path, digest in (f.get("model_sources") or {}).items()
                if _source_sha256(path) not in (None, digest)]  # (a file gone: cannot tell, as for the factory's)
    edited = bool(changed)
    if edited:
        progress.warn(f"{' and '.join(changed)} {'were' if len(changed) > 1 else 'was'} edited since the compile: "
                      f"eager runs the code as it is now, which may differ from what the artifact compiled")
    state = module.state_dict(keep_vars=True)
    buffers = dict(module.named_buffers(remove_duplicate=False))
    state.update(buffers)  # with the non-persistent buffers
    attributes = attribute_walk(module)  # name -> (tensor, path)
    state.update((name, t) for name, (t, _) in attributes.items())  # and plain tensor attributes (plan constants)
    sources = art.manifest.get("param_sources") or {}
    device = next((t.device for t in state.values()), torch.device("cpu"))
    # the buffers the plan kept as constants (const_<placeholder>), and those it folded into other values as
    # compiled (state.safetensors, up to a size); larger folded ones are not stored
    buffer_sources = art.manifest.get("buffer_sources") or {}
    try:
        params = art.params()
        consts = art.constants() if buffer_sources else {}
        folded_state = art.folded_state() if buffer_sources else {}
    except ArtifactError as e:  # a file not the manifest's or unreadable: bad input (2), as elsewhere
        raise Failure(str(e)) from e
    stored = [(name, consts[const_name(name)], target) for name, target in buffer_sources.items()
              if const_name(name) in consts]
    stored += [(name, folded_state[name], target) for name, target in buffer_sources.items()
               if const_name(name) not in consts and name in folded_state]
    folded = sorted(target for name, target in buffer_sources.items()
                    if const_name(name) not in consts and name not in folded_state)
    changed, unmapped = 0, []
    with torch.no_grad():
        for name, t, key in [*((n, t, sources.get(n)) for n, t in params.items()), *stored]:
            target = state.get(key) if key else None
            if target is None or tuple(target.shape) != tuple(t.shape):
                why = ("no such entry" if target is None else f"shape {tuple(target.shape)} there") if key else "no source"
                unmapped.append(f"{name} {tuple(t.shape)} -> {key or '?'} ({why})")
                continue
            if target.dtype != t.dtype:  # another module than the one compiled: eager would not be the reference
                raise Failure(f"the factory ({f['spec']}) now builds {key} as {str(target.dtype).removeprefix('torch.')} "
                              f"on {target.device}, but the artifact compiled it as "
                              f"{str(t.dtype).removeprefix('torch.')} (on {art.manifest.get('device', '?')}): the "
                              f"factory builds another module on this machine (does it pick its dtype by the device?), "
                              f"so its eager run is no reference for this artifact; make its dtype explicit, or "
                              f"compile on this machine")
            t = t.to(target.device)
            if not torch.equal(target, t):
                # attributes are replaced (they may be expanded views or inference tensors, which copy_ refuses);
                # buffers written in place where they can be, which keeps a buffer that views another one a view
                if key in attributes:
                    _replace_state(module, buffers, attributes, target, t.clone())
                else:
                    try:
                        target.copy_(t)
                    except RuntimeError:  # (refused before writing anything)
                        if key not in buffers:
                            raise
                        _replace_state(module, buffers, attributes, target, t.clone())
                changed += 1
    if changed:
        progress(f"note: the factory's weights differ from the artifact's in {changed} tensor(s) (not deterministic?); "
                 f"eager uses the artifact's weights and buffers")
    if unmapped:
        shown = "; ".join(unmapped[:3]) + ("; ..." if len(unmapped) > 3 else "")
        progress.warn(f"{len(unmapped)} of the artifact's parameter(s) or buffer(s) could not be matched to the "
                      f"factory module's state ({shown}): has the factory changed since the compile? Eager uses "
                      f"the factory's own values for them")
    return module.eval(), device, [] if edited else folded  # (an edit, warned of, says more than the buffers)


# ---- bench -------------------------------------------------------------------------------

def bench_artifact(progress: Progress, artifact_dir: Path, executor: str | None, iters: int | None, warmup: int) -> None:
    """``tilec bench``: times eager, eager under a CUDA graph and tilec, as a table."""
    from rich.console import Console
    from rich.table import Table

    art = open_artifact(artifact_dir)
    program = build_program(art, executor, progress)
    cuda = program.device.type == "cuda"
    iters = iters or (100 if cuda else 10)
    positions = art.manifest["call"]["positions"]
    rows = []
    try:
        module, device, _ = eager_reference(art, progress)
    except Failure as e:
        note = f"n/a: {e.format_message()}"
        rows += [("eager PyTorch", None, note), ("eager PyTorch under a CUDA graph", None, note)]
    else:
        eager_step = _repeatable(module, art.inputs(device), positions)
        with progress.step(f"timing eager PyTorch on {device.type}"):
            rows.append((f"eager PyTorch ({device.type})", *_try_time(eager_step, iters, warmup, device)))
        if device.type == "cuda":
            with progress.step("capturing and timing a CUDA graph"):
                try:
                    replay = cuda_graph(eager_step).replay
                except Exception as e:  # capture fails for modules that sync or allocate on the host
                    rows.append(("eager PyTorch under a CUDA graph", None, f"n/a: capture failed: {e}"))
                else:
                    rows.append(("eager PyTorch under a CUDA graph", *_try_time(replay, iters, warmup, device)))
        else:
            why = "the model is on the CPU" if torch.cuda.is_available() else "no CUDA"
            rows.append(("eager PyTorch under a CUDA graph", None, f"n/a: {why}"))
    tilec_step = _repeatable(lambda *a: _run_step(program, a), art.inputs(program.device), positions)
    with progress.step(f"timing tilec ({program.executor_kind} executor)"):
        label = "tilec (persistent CUDA kernel)" if cuda else "tilec (CPU reference executor)"
        times, note = _try_time(tilec_step, iters, warmup, program.device)
        rows.append((label, times, note or ("" if cuda else "validation executor, not a speed measurement")))
    tilec_failed = times is None
    base = rows[0][1]
    table = Table(title=f"tilec bench {art.path} ({iters} steps, median)")
    for col, just in (("step", "left"), ("median ms", "right"), ("min ms", "right"), ("vs eager", "right"),
                      ("note", "left")):
        table.add_column(col, justify=just)
    for label, times, note in rows:
        if times is None:
            table.add_row(label, "n/a", "n/a", "", note)
            continue
        med = statistics.median(times)
        speed = f"{statistics.median(base) / med:.2f}x" if base else ""
        table.add_row(label, f"{med * 1e3:.3f}", f"{min(times) * 1e3:.3f}", speed, note)
    Console(width=140).print(table)
    if tilec_failed:  # the table is still printed, but the command failed (a run-time error)
        raise Failure(f"tilec step: {rows[-1][2].removeprefix('n/a: ')}", EXIT_ERROR)




def _repeatable(fn, args: list, positions: list[int]):
    """``fn(*args)`` as a step that can run again and again: the position inputs (which a step may
    advance in place, like HF's cache counters) are restored first, so every step is the same."""
    saved = [(args[i], args[i].clone()) for i in positions if isinstance(args[i], torch.Tensor)]

    @torch.no_grad()
    def step():
        for t, v in saved:
            t.copy_(v)
        return fn(*args)

    return step


def _try_time(fn, iters: int, warmup: int, device: torch.device) -> tuple[list[float] | None, str]:
    try:
        return step_times(fn, iters, warmup, device), ""
    except Failure as e:
        return None, f"n/a: {e.format_message()}"
    except Exception as e:
        return None, f"n/a: failed: {type(e).__name__}: {e}"

