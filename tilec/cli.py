"""The ``tilec`` command line: compile a model factory into an artifact, inspect, run and bench it.

    tilec compile MODULE:FACTORY -o DIR [--option KEY=VALUE ...] [--force] [--no-build]
    tilec inspect DIR [--stage S] [--format text|json|dot]
    tilec run DIR [--executor cuda|reference] [--check [--tol X]]
    tilec bench DIR [--executor cuda|reference] [--iters N] [--warmup N]

A factory is a function taking no arguments that returns ``(module, example_args)`` or
``(module, example_args, dict(positions=..., max_positions=...))`` (see ``examples/factories.py``);
MODULE is a dotted module name importable from the current directory, or a path to a .py file.
The artifact format is described in :mod:`tilec.artifact`.

Exit codes: 0 ok; 1 ``run --check`` found a mismatch; 2 usage or bad input (arguments, options,
factory, artifact, missing GPU, an artifact or standard output that cannot be written: a full disk); 3 compile error (including nvcc); 4 the step failed at run time,
or an internal error; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM: ``timeout``, a batch scheduler,
``docker stop``), which stops a command as Ctrl-C does - nvcc killed, no partial artifact left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import click

import tilec

from .errors import TilecError
from .options import OPTION_TYPES
from .stages import STAGES

# The commands' work is in tilec.commands, imported when a command runs: `tilec --help` and usage
# errors answer without importing torch.
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_COMPILE, EXIT_ERROR = 0, 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT / SIGTERM, the shell's convention


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: a command stops as on Ctrl-C (every ``except KeyboardInterrupt`` /
    ``finally`` cleans up, the build kills nvcc's process group) instead of the process dying where it stands."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _restore_sigterm() -> None:
    """The default SIGTERM action again, unless something the command ran installed its own handler."""
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def entry() -> None:
    """The ``tilec`` console script and ``python -m tilec``: :func:`main`, then SIGTERM ignored for the interpreter's
    teardown (about a second with torch loaded), so that the process ends with the command's exit code: its work is
    done (such a SIGTERM after ``wrote ...`` exited 143, the code of a compile stopped before its artifact, over a
    whole artifact: a fresh user's finding). Ignored, not handled or blocked: CPython puts a handled signal's default
    action back before the long part of its teardown, and a blocked one goes to another thread (torch's). For a
    process that ends with the command: in-process, call ``main``."""
    try:
        main(prog_name="tilec")
    except SystemExit:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _on_sigterm):  # (not over a command's own)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise


class Failure(click.ClickException):
    """An error shown as ``tilec: error: ...`` that exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = code

    def show(self, file=None) -> None:
        click.echo(f"tilec: error: {self.format_message()}", err=True)


class Progress:
    """Progress lines on stderr: each step announces itself and, when it took over a second, its time."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            click.echo(f"tilec: {message}", err=True)

    def warn(self, message: str) -> None:
        """A warning: shown under ``-q`` too (it is not progress)."""
        click.echo(f"tilec: warning: {message}", err=True)

    @contextlib.contextmanager
    def step(self, what: str):
        self(f"{what} ...")
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        if dt >= 1.0:
            self(f"{what}: done in {dt:.1f} s")


class _Group(click.Group):
    """Turns errors that escaped a command into exit code 4 with a one-line message."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.NoSuchOption as e:  # `compile --workers 8`: tilec's options go through -O
            name = e.option_name.lstrip("-").replace("-", "_")
            if e.ctx is not None and e.ctx.command.name == "compile" and \
                    name in OPTION_TYPES:
                raise click.NoSuchOption(e.option_name, f"No such option: {e.option_name}. tilec options are given "
                                                        f"as -O KEY=VALUE, e.g. -O {name}=...", ctx=e.ctx) from None
            if e.ctx is not None and e.ctx.parent is not None and e.option_name in ("-q", "--quiet"):
                raise click.NoSuchOption(e.option_name, f"No such option: {e.option_name}. It goes before the "
                                                        f"command: tilec {e.option_name} {e.ctx.command.name} ...",
                                         ctx=e.ctx) from None
            raise
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: 128 + the signal, not 1 (a --check mismatch)
            term = isinstance(e, Terminated)
            click.echo(f"tilec: {'terminated' if term else 'interrupted'}", err=True)
            raise click.exceptions.Exit(EXIT_TERMINATED if term else EXIT_INTERRUPTED) from None
        except BrokenPipeError:  # `tilec inspect DIR | head`: stop quietly
            stdout_to_devnull()
            raise click.exceptions.Exit(EXIT_OK) from None
        except TilecError as e:
            raise Failure(str(e), EXIT_ERROR) from e
        except OSError as e:  # `tilec inspect DIR > file` on a full disk: the user's output, not a tilec bug
            if e.errno is None or not _on_stdout(e):
                traceback.print_exc()
                raise Failure(f"internal error: {type(e).__name__}: {e} (please report it)", EXIT_ERROR) from e
            stdout_to_devnull()
            raise Failure(f"cannot write to standard output: {e.strerror or e}") from None
        except Exception as e:
            traceback.print_exc()
            raise Failure(f"internal error: {type(e).__name__}: {e} (please report it)", EXIT_ERROR) from e


def stdout_to_devnull() -> None:
    """Points standard output's descriptor at /dev/null: what is left in its buffer goes nowhere at exit (no second
    error from Python's final flush to a closed pipe or a full disk)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)


def _on_stdout(e: BaseException) -> bool:
    """Whether ``e`` was raised writing to standard output: the innermost frame of its traceback (click.echo's,
    rich's console's) holds the stream it wrote to, open on stdout's descriptor."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no stdout, a closed one, or one in memory
        return False
    for value in (tb.tb_frame.f_locals.values() if tb is not None else ()):
        for stream in (value, getattr(value, "file", None)):  # (rich's Console holds its stream as .file)
            with contextlib.suppress(AttributeError, OSError, TypeError, ValueError):
                if stream is not None and stream.fileno() == fd:
                    return True
    return False


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(tilec.__version__, prog_name="tilec")
@click.option("-q", "--quiet", is_flag=True, help="No progress output on stderr.")
@click.pass_context
def main(ctx: click.Context, quiet: bool) -> None:
    """Compile PyTorch decode steps to tile instruction streams for one persistent CUDA kernel.

    Exit codes: 0 ok, 1 check mismatch, 2 usage or bad input, 3 compile error, 4 run-time error,
    130 interrupted, 143 terminated.
    """
    ctx.obj = Progress(quiet)
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # never over a handler the caller installed
        signal.signal(signal.SIGTERM, _on_sigterm)
        ctx.call_on_close(_restore_sigterm)  # (main() called in-process)
    for category in (FutureWarning, DeprecationWarning):  # third-party noise (torch.export, transformers)
        warnings.filterwarnings("ignore", category=category)
    _absolute_cache_dir(ctx)


def _absolute_cache_dir(ctx: click.Context) -> None:
    """A relative ``$TILEC_CACHE_DIR`` made absolute for the command: a factory that changes directory
    would otherwise have the library built in another cache than the one checked writable before it ran
    (put back when the command ends, for in-process calls)."""
    env = os.environ.get("TILEC_CACHE_DIR")
    if env and not os.path.isabs(env):
        os.environ["TILEC_CACHE_DIR"] = os.path.abspath(env)

        def restore() -> None:
            os.environ["TILEC_CACHE_DIR"] = env
        ctx.call_on_close(restore)


def _path(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    """A path option's value as a Path; an empty one is a usage error (``Path("")`` would be the
    current directory)."""
    if not value:
        raise click.BadParameter("an empty path; give a new directory (e.g. -o out)" if param.name == "output" else
                                 "an empty path; give the artifact's directory (\".\" for the current one)")
    return Path(value)


# ---- compile -----------------------------------------------------------------------------

@main.command("compile")
@click.argument("factory", metavar="MODULE:FACTORY")
@click.option("-o", "--output", required=True, type=click.Path(), callback=_path, help="Artifact directory to write.")
@click.option("-O", "--option", "option_pairs", multiple=True, metavar="KEY=VALUE",
              help="A tilec option (tilec.options.Options), e.g. workers=8; repeatable.")
@click.option("--force", is_flag=True, help="Replace an existing artifact at the output path.")
@click.option("--no-build", is_flag=True, help="Do not build cuda/libtilec.so even when nvcc is present.")
@click.pass_obj
def compile_cmd(progress: Progress, factory: str, output: Path, option_pairs, force: bool, no_build: bool) -> None:
    """Compile the module returned by FACTORY() and write an artifact directory.

    MODULE is a dotted module name (importable from the current directory) or a path to a
    .py file; FACTORY() returns (module, example_args) or (module, example_args,
    dict(positions=..., max_positions=...)). Example:

    \b
        tilec compile examples/factories.py:tiny_llama_step -o out/llama -O workers=8
    """
    from .commands import compile_artifact

    compile_artifact(progress, factory, output, option_pairs, force, no_build)


# ---- inspect -----------------------------------------------------------------------------

@main.command()
@click.argument("artifact_dir", metavar="DIR", type=click.Path(), callback=_path)
@click.option("-s", "--stage", default=None,
              help=f"One stage: {', '.join(f'{i:02d}-{n}' for i, n in enumerate(STAGES, 1))} (name or number).")
@click.option("-f", "--format", "fmt", type=click.Choice(["text", "json", "dot"]), default="text", show_default=True,
              help="text: the stable IR text; json: structured dump; dot: graphviz of one stage's graph (the plan's "
                   "task/event graph unless --stage names another).")
@click.pass_obj
def inspect(progress: Progress, artifact_dir: Path, stage: str | None, fmt: str) -> None:
    """Print every stage of an artifact (or one with --stage); --format dot prints one graph: --stage's, else the
    plan's."""
    from .commands import inspect_artifact

    inspect_artifact(progress, artifact_dir, stage, fmt)


# ---- run ---------------------------------------------------------------------------------

@main.command()
@click.argument("artifact_dir", metavar="DIR", type=click.Path(), callback=_path)
@click.option("--executor", type=click.Choice(["cuda", "reference"]), default=None,
              help="Default: cuda when a GPU is available, else the CPU reference executor.")
@click.option("--check", is_flag=True, help="Compare outputs and updated state with eager PyTorch (re-runs the "
                                            "factory recorded in the manifest, with the artifact's weights).")
@click.option("--tol", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Relative L2 tolerance of --check (requires --check), finite and > 0 (default 1e-4 for "
                   "float32 results, 2e-2 otherwise).")
@click.pass_obj
def run(progress: Progress, artifact_dir: Path, executor: str | None, check: bool, tol: float | None) -> None:
    """Run an artifact once on its stored example inputs."""
    from .commands import run_artifact

    run_artifact(progress, artifact_dir, executor, check, tol)


# ---- bench -------------------------------------------------------------------------------

@main.command()
@click.argument("artifact_dir", metavar="DIR", type=click.Path(), callback=_path)
@click.option("--executor", type=click.Choice(["cuda", "reference"]), default=None,
              help="Default: cuda when a GPU is available, else the CPU reference executor.")
@click.option("--iters", type=click.IntRange(1), default=None, help="Timed steps (default 100 on CUDA, 10 on CPU).")
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True)
@click.pass_obj
def bench(progress: Progress, artifact_dir: Path, executor: str | None, iters: int | None, warmup: int) -> None:
    """Time eager PyTorch, eager under one CUDA graph, and tilec on the artifact's inputs."""
    from .commands import bench_artifact

    bench_artifact(progress, artifact_dir, executor, iters, warmup)


if __name__ == "__main__":
    main(prog_name="tilec")
