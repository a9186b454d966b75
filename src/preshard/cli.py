"""Command line: parses arguments and calls the library.

Exit status: 0 success; 1 `verify` found problems; 2 a usage or input error (one line, `error: ...`, no
traceback); 130 interrupted by SIGINT, 143 by SIGTERM (a conversion keeps its finished part: re-run the
same command to resume).

Conventions: `--help`/`-h` on every command (with the exit codes), `--version` on both entry points, `--json`
where a program may read the output (inspect, verify, plan, convert --dry-run), and `--progress/--no-progress`
where there is long work measured in bytes (convert, verify: on by default when stderr is a terminal, plain
periodic lines when it is not; it also switches huggingface_hub's download bars). `inspect` and `plan` have none:
they read a manifest or safetensors headers and finish in moments. `demo` has none: it prints each of its steps as
a numbered line, its conversion of a few MB takes well under a second, and its long step (the torchrun job) has no
byte count to show.
"""

from __future__ import annotations

import errno
import functools
import gc
import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

from preshard import __version__
from preshard.converter.signals import interruption, raising_signals, received_signal
from preshard.errors import Interrupted, PreshardError, ResourceError

EXIT_PROBLEMS, EXIT_USAGE = 1, 2
EXIT_CODES_HELP = (
    "Exit status: 0 ok, 1 verify found problems, 2 usage or input error, 130 interrupted (SIGINT), 143 terminated."
)
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def _fail(message: str, status: int = EXIT_USAGE) -> None:
    signum = received_signal()
    if signum is not None and status != 128 + signum:  # the signal came first: its exception may have been swallowed
        message, status = str(interruption(signum)), 128 + signum
    click.echo(f"error: {message}", err=True)
    sys.exit(status)


def user_errors(fn):
    """Library errors become one line on stderr and exit status 2 (130/143 when interrupted), no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Interrupted as exc:
            _fail(str(exc), 128 + exc.signal_number)
        except PreshardError as exc:
            _fail(str(exc))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                _fail(f"the disk is full ({exc.filename or 'while writing'}); free space and re-run to resume")
            _fail(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        except KeyboardInterrupt:
            _fail("interrupted", 128 + signal.SIGINT)
        except Exception as exc:
            if received_signal() is not None:  # what broke after a signal (a module it left half-imported): the signal
                _fail("interrupted")  # is the cause, and _fail reports it
            resource = ResourceError.of(exc, f"running {fn.__name__.removesuffix('_command')}")
            if resource is None:
                raise
            _fail(str(resource))

    return wrapper


class _OneLineErrors:
    """click's own usage errors (`--tp abc`, a missing argument) as one line and exit status 2.

    SIGINT and SIGTERM raise `Interrupted` for the whole command (the converter defers both while it writes),
    so either ends with one line and 130/143 rather than a traceback or a silent death. Run as a program
    (`args` not given), the command then ignores both for the last moments of the process: its outcome is
    decided and printed, and a signal during the interpreter's shutdown would only garble it.
    """

    def main(self, args=None, *rest, **kwargs):
        program = args is None
        try:
            with raising_signals(ignore_after=program):
                return self._main_one_line(args, *rest, **kwargs)
        except Interrupted as exc:  # a signal whose exception was swallowed: the command must not succeed
            _fail(str(exc), 128 + exc.signal_number)
        finally:
            if program:  # the process ends now: its last collections need not walk torch's objects (~1 s of exit)
                gc.freeze()

    def _main_one_line(self, *args, **kwargs):
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except Interrupted as exc:
            _fail(str(exc), 128 + exc.signal_number)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            _fail("interrupted", 128 + signal.SIGINT)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "preshard"
            _fail(f"{exc.format_message()} (see {command} --help)")
        except click.ClickException as exc:
            _fail(exc.format_message())
        except Exception:
            if received_signal() is None:
                raise
            _fail("interrupted")  # reports the signal received, whatever broke after it


class Command(_OneLineErrors, click.Command):
    pass


class Group(_OneLineErrors, click.Group):
    command_class = Command


def _progress_option(fn):
    return click.option(
        "--progress/--no-progress",
        default=None,
        help="Show progress (default: on when stderr is a terminal; plain periodic lines when it is not).",
    )(fn)


@contextmanager
def _hub_progress(progress: bool | None) -> Iterator[None]:
    """huggingface_hub's download bars follow --progress/--no-progress (off by default when stderr is no terminal)."""
    show = sys.stderr.isatty() if progress is None else progress
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        yield
        return
    was_disabled = are_progress_bars_disabled()
    if not show:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was_disabled:
            enable_progress_bars()


def _hub_options(fn):
    fn = click.option("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")(fn)
    fn = click.option("--revision", default=None, help="Hub branch, tag or commit (default: the default branch).")(fn)
    return click.option(
        "--subfolder", default=None, help="Folder inside SOURCE (a Hub repo or local folder), e.g. transformer."
    )(fn)


@click.command(name="convert-checkpoint", cls=Command, context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("source")
@click.argument("output", type=click.Path(path_type=str))
@click.option("--tp", type=click.IntRange(min=1), required=True, help="Tensor-parallel degree.")
@click.option("--cp", type=click.IntRange(min=1), default=None, help="Context-parallel degree (= --ulysses N).")
@click.option("--ring", type=click.IntRange(min=1), default=None, help="Ring-attention degree.")
@click.option("--ulysses", type=click.IntRange(min=1), default=None, help="Ulysses degree.")
@click.option("--order", default=None, help="Mesh axis order, default tp,ring,ulysses (last varies fastest).")
@click.option("--plan", "plan", default=None, help="Built-in plan name or JSON plan file (default: from config.json).")
@click.option("--dtype", default=None, help="Cast floating tensors: bf16, fp16 or fp32 (default: keep each dtype).")
@_hub_options
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it is a preshard checkpoint.")
@click.option("--wait", is_flag=True, help="Wait for another conversion into OUTPUT to finish instead of failing.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Resolve source (Hub: headers only), plan and mesh; print per-rank bytes, output size, free space and a "
    "time estimate from a short read/write probe; write nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the report as one JSON object.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Local processes converting in parallel (at most --tp; several hosts: torchrun -m preshard.torchrun_convert).",
)
@_progress_option
@click.version_option(__version__, "--version", prog_name="convert-checkpoint")
@user_errors
def convert_checkpoint_command(
    source, output, tp, cp, ring, ulysses, order, plan, dtype, subfolder, revision, token, overwrite, wait, dry_run,
    as_json, workers, progress,
):  # fmt: skip
    """Slice SOURCE (.safetensors file, diffusers weights folder or Hub repo id) into per-rank shards in OUTPUT."""
    from preshard.converter.convert import convert_checkpoint, resolve_mesh

    if as_json and not dry_run:
        _fail("--json goes with --dry-run (a conversion prints one summary line); add --dry-run or drop --json")
    if dry_run:
        from preshard.tools.planner import dry_run as plan_dry_run
        from preshard.tools.planner import dry_run_json, dry_run_text

        mesh = resolve_mesh(None, tp, cp, ring, ulysses, order)
        with _hub_progress(progress):
            report = plan_dry_run(
                source, output, mesh=mesh, plan=plan, dtype=dtype, subfolder=subfolder, revision=revision,
                token=token, overwrite=overwrite,
            )  # fmt: skip
        click.echo(json.dumps(dry_run_json(report), indent=1) if as_json else dry_run_text(report))
        if report.space_error:
            _fail(report.space_error)
        return
    from preshard.tools.inspect import summary_line

    with _hub_progress(progress):
        manifest = convert_checkpoint(
            source, output, tp=tp, cp=cp, ring=ring, ulysses=ulysses, order=order, plan=plan, dtype=dtype,
            subfolder=subfolder, revision=revision, token=token, overwrite=overwrite, wait=wait, progress=progress,
            workers=workers,
        )  # fmt: skip
    click.echo(summary_line(manifest, output))


@click.group(cls=Group, context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.version_option(__version__, "--version", prog_name="preshard")
def main() -> None:
    """preshard: pre-sharded checkpoints for tensor x context parallel inference."""


main.add_command(convert_checkpoint_command, name="convert")


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@user_errors
def inspect(checkpoint, as_json):
    """Print the provenance, mesh, data files and the bytes each rank reads."""
    from preshard.format.manifest import read_manifest
    from preshard.tools.inspect import inspect_data, inspect_table

    manifest = read_manifest(checkpoint)
    click.echo(json.dumps(inspect_data(manifest), indent=1) if as_json else inspect_table(manifest))


@main.command(name="verify", epilog=EXIT_CODES_HELP)
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--source", default=None, help="Also compare every tensor with this source checkpoint, bit for bit.")
@click.option("--subfolder", default=None, help="Folder inside a Hub --source.")
@click.option("--revision", default=None, help="Revision of a Hub --source.")
@click.option("--token", default=None, help="Hub token.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@_progress_option
@user_errors
def verify_command(checkpoint, source, subfolder, revision, token, as_json, progress):
    """Check a converted checkpoint: manifest, files, checksums, framing, .metadata, config (and the source).

    Prints one line per problem and exits 1 if anything is wrong; exits 0 with a one-line summary if not.
    """
    from preshard.tools.verify import verify_checkpoint

    with _hub_progress(progress):
        result = verify_checkpoint(
            checkpoint, source=source, subfolder=subfolder, revision=revision, token=token, progress=progress
        )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        for line in result.report_lines():
            click.echo(line)
        click.echo(result.summary())
    if not result.ok:
        sys.exit(EXIT_PROBLEMS)


@main.command(name="reshard", epilog=EXIT_CODES_HELP)
@click.argument("checkpoint")
@click.argument("output", type=click.Path(path_type=str))
@click.option("--tp", type=click.IntRange(min=1), required=True, help="New tensor-parallel degree.")
@click.option("--cp", type=click.IntRange(min=1), default=None, help="Context-parallel degree (= --ulysses N).")
@click.option("--ring", type=click.IntRange(min=1), default=None, help="Ring-attention degree.")
@click.option("--ulysses", type=click.IntRange(min=1), default=None, help="Ulysses degree.")
@click.option("--order", default=None, help="Mesh axis order (default: the checkpoint's).")
@click.option("--revision", default=None, help="Hub branch, tag or commit of a Hub CHECKPOINT.")
@click.option("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it is a preshard checkpoint.")
@click.option("--wait", is_flag=True, help="Wait for another conversion into OUTPUT to finish instead of failing.")
@_progress_option
@user_errors
def reshard_command(checkpoint, output, tp, cp, ring, ulysses, order, revision, token, overwrite, wait, progress):
    """Write CHECKPOINT (a converted folder or Hub repo id) for another mesh into OUTPUT; no source needed.

    CP options left out keep the checkpoint's. The same TP degree (a CP-only change) links the data files and
    writes only a new manifest.
    """
    from preshard.tools.inspect import summary_line
    from preshard.tools.reshard import reshard_checkpoint

    with _hub_progress(progress):
        manifest = reshard_checkpoint(
            checkpoint, output, tp=tp, cp=cp, ring=ring, ulysses=ulysses, order=order, revision=revision,
            token=token, overwrite=overwrite, wait=wait, progress=progress,
        )  # fmt: skip
    click.echo(summary_line(manifest, output))


@main.command(name="unshard", epilog=EXIT_CODES_HELP)
@click.argument("checkpoint")
@click.argument("output", type=click.Path(path_type=str))
@click.option("--revision", default=None, help="Hub branch, tag or commit of a Hub CHECKPOINT.")
@click.option("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it is a safetensors checkpoint folder.")
@_progress_option
@user_errors
def unshard_command(checkpoint, output, revision, token, overwrite, progress):
    """Rebuild the source safetensors checkpoint of CHECKPOINT in OUTPUT, bit for bit, in its own layout.

    Same file names, headers and index as the source, and config.json. Refused for a checkpoint converted with
    a --dtype that lost precision.
    """
    from preshard.tools.unshard import unshard_checkpoint
    from preshard.units import human_bytes

    with _hub_progress(progress):
        files = unshard_checkpoint(
            checkpoint, output, revision=revision, token=token, overwrite=overwrite, progress=progress
        )
    size = sum(f.stat().st_size for f in files)
    click.echo(f"wrote {output}: {len(files)} files, {human_bytes(size)}; every file matches the source")


@main.command(name="plan", epilog=EXIT_CODES_HELP)
@click.argument("source")
@click.option("--devices", type=click.IntRange(min=1), default=None, help="Devices in the job (default: TP alone).")
@click.option(
    "--device-memory", type=click.FloatRange(min=0, min_open=True), default=None, help="Memory of one device, GiB."
)
@click.option("--plan", "plan", default=None, help="Built-in plan name or JSON plan file (default: from config.json).")
@click.option("--dtype", default=None, help="Plan for a cast: bf16, fp16 or fp32 (default: keep each dtype).")
@_hub_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per mesh.")
@user_errors
def plan_command(source, devices, device_memory, plan, dtype, subfolder, revision, token, as_json):
    """Which TP x CP meshes fit: per-rank weights, load reads and disk, from safetensors headers only.

    SOURCE is a local checkpoint or a Hub repo id (headers read with ranged requests; no weights downloaded).
    Every TP degree the plan allows up to --devices is listed, with every ring x ulysses split of the remaining
    devices. Weights only: activations and the compiler's workspace come on top.
    """
    from preshard.tools.planner import plan_json, plan_meshes, plan_table

    with _hub_progress(False):
        report = plan_meshes(
            source, devices=devices, device_memory_gib=device_memory, plan=plan, dtype=dtype, subfolder=subfolder,
            revision=revision, token=token,
        )  # fmt: skip
    click.echo(json.dumps(plan_json(report), indent=1) if as_json else plan_table(report))


@main.command(epilog=EXIT_CODES_HELP)
@click.option("--tp", type=click.IntRange(min=1), default=2, show_default=True, help="Tensor-parallel degree.")
@click.option("--ring", type=click.IntRange(min=1), default=1, show_default=True, help="Ring-attention degree.")
@click.option("--ulysses", type=click.IntRange(min=1), default=2, show_default=True, help="Ulysses degree.")
@click.option("--seq-len", type=click.IntRange(min=3), default=37, show_default=True, help="Packed sequence rows.")
@click.option("--workdir", type=click.Path(path_type=str), default=None, help="Keep the files here (default: temp).")
@user_errors
def demo(tp, ring, ulysses, seq_len, workdir):
    """Convert an embedded MiniMax-H3 example and run it sharded under torchrun on the CPU."""
    from preshard.demo import run_demo

    run_demo(tp=tp, ring=ring, ulysses=ulysses, seq_len=seq_len, workdir=workdir, echo=click.echo)


if __name__ == "__main__":
    main()
