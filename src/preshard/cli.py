"""Command line: parses arguments and calls the library.

Exit status: 0 success; 1 `verify` found problems; 2 a usage or input error (one line, `error: ...`, no
traceback); 130 interrupted by SIGINT, 143 by SIGTERM (a conversion keeps its finished part: re-run the
same command to resume).

Conventions, the same on every command: `--help`/`-h` (with the exit codes); `--version` on both entry points;
`--json` (one JSON object on stdout saying what the command did or found, nothing else there); `--quiet`/`-q`
(nothing on stdout but that JSON when asked for, no progress; errors still go to stderr); `--progress/--no-progress`
(on by default when stderr is a terminal, plain periodic lines when it is not; it also switches huggingface_hub's
download bars); `--subfolder/--revision/--token` wherever a Hub repo id is accepted; `--dry-run` on the commands
that write (convert, reshard, unshard).
"""

from __future__ import annotations

import errno
import functools
import json
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import click

from preshard import __version__
from preshard.converter.signals import command_scope, interruption, received_signal
from preshard.errors import Interrupted, PipelineRepoError, PreshardError, ResourceError, UsageError

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
        if program:  # the dry runs count this process's own start-up, which the real command pays again
            kwargs.setdefault("obj", {})["program"] = True
        try:
            # Signals as one line, the cyclic GC paused: the one scoped context a command runs in.
            with command_scope(program=program):
                return self._main_one_line(args, *rest, **kwargs)
        except Interrupted as exc:  # a signal whose exception was swallowed: the command must not succeed
            _fail(str(exc), 128 + exc.signal_number)

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


def _output_options(fn):
    """--json, --quiet/-q and --progress/--no-progress: every command takes all three."""
    fn = click.option(
        "--progress/--no-progress",
        default=None,
        help="Show progress (default: on when stderr is a terminal; plain periodic lines when it is not).",
    )(fn)
    fn = click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors (and the --json object).")(fn)
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object of what was done.")(fn)


def _progress(progress: bool | None, quiet: bool) -> bool | None:
    return False if quiet and progress is None else progress


def _start_seconds() -> float:
    """What a command run as a program paid before its work (interpreter, imports): the dry runs' estimates add it."""
    from preshard.tools.estimate import process_age

    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return process_age() if isinstance(obj, dict) and obj.get("program") else 0.0


def _emit(data: dict, text: str, as_json: bool, quiet: bool) -> None:
    """The command's result: its JSON object, or its text unless --quiet."""
    if as_json:
        click.echo(json.dumps(data, indent=1))
    elif not quiet:
        click.echo(text)


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


def _hub_options(what: str = "SOURCE"):
    def options(fn):
        fn = click.option("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")(fn)
        fn = click.option(
            "--revision", default=None, help=f"Branch, tag or commit of a Hub {what} (default: the default branch)."
        )(fn)
        return click.option(
            "--subfolder", default=None, help=f"Folder inside {what} (a Hub repo or local folder), e.g. transformer."
        )(fn)

    return options


def _manifest_summary(manifest, output: str) -> dict:
    """What a command that wrote a checkpoint says in its JSON object."""
    return {
        "output": str(output),
        "tensors": len(manifest.tensors),
        "mesh": manifest.mesh.to_dict() | {"world_size": manifest.mesh.world_size},
        "plan": manifest.plan.name,
        "files": [{"name": f.name, "size": f.size, "xxh3_128": f.xxh3_128} for f in manifest.files],
        "data_bytes": sum(f.size for f in manifest.files),
        "manifest_digest": manifest.digest,
    }


class _ConvertCommand(Command):
    """`--lora FILE [--lora-scale S]`, repeatable: each --lora-scale applies to the --lora before it (default 1.0),
    which needs the options' command-line order; click gives each option's values alone, so that order is read
    from click's own parser and the pairs are passed as `loras`."""

    def parse_args(self, ctx, args):
        order = self.make_parser(ctx).parse_args(args=list(args))[2]
        rest = super().parse_args(ctx, args)
        files, scales = list(ctx.params.pop("lora", None) or ()), list(ctx.params.pop("lora_scale", None) or ())
        pairs: list[list] = []
        for param in order:
            if param.name == "lora":
                pairs.append([files[len(pairs)], None])
            elif param.name == "lora_scale":
                if not pairs or pairs[-1][1] is not None:
                    raise click.UsageError(
                        "each --lora-scale follows the --lora it scales: --lora FILE --lora-scale S", ctx=ctx
                    )
                pairs[-1][1] = scales.pop(0)
        ctx.params["loras"] = [(path, 1.0 if scale is None else scale) for path, scale in pairs]
        return rest


@click.command(name="convert-checkpoint", cls=_ConvertCommand, context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("source")
@click.argument("output", type=click.Path(path_type=str))
@click.option("--tp", type=click.IntRange(min=1), required=True, help="Tensor-parallel degree.")
@click.option("--cp", type=click.IntRange(min=1), default=None, help="Context-parallel degree (= --ulysses N).")
@click.option("--ring", type=click.IntRange(min=1), default=None, help="Ring-attention degree.")
@click.option("--ulysses", type=click.IntRange(min=1), default=None, help="Ulysses degree.")
@click.option("--order", default=None, help="Mesh axis order, default tp,ring,ulysses (last varies fastest).")
@click.option(
    "--plan", "plan", default=None,
    help="Built-in plan name, JSON plan file, or auto (inferred from the model's modules); default: from config.json.",
)  # fmt: skip
@click.option("--dtype", default=None, help="Cast floating tensors: bf16, fp16 or fp32 (default: keep each dtype).")
@click.option(
    "--lora",
    multiple=True,
    metavar="FILE",
    help="Fuse this LoRA (.safetensors, any key format diffusers reads for the model; or a Hub org/name[/file]) "
    "into the weights before slicing. Repeatable, applied in order.",
)
@click.option(
    "--lora-scale", type=float, multiple=True, metavar="S", help="Scale of the --lora before it (default 1.0)."
)
@click.option(
    "--quantize",
    default=None,
    metavar="FORMAT",
    help="Store the plan's sharded Linear weights quantized: fp8 (float8_e4m3fn) or int8, each with a float32 "
    "per-output-channel weight_scale (see docs/quantized.md).",
)
@click.option(
    "--model-class",
    "model_class",
    default=None,
    metavar="MODULE:CLASS",
    help="The model's class where it is not in diffusers or transformers, e.g. my_models.dit:MyDiT: your code, "
    "imported from the Python path (config.json never names code to import). Recorded in the manifest.",
)
@_hub_options()
@click.option(
    "--component",
    "component_choices",
    multiple=True,
    metavar="NAME:CHOICE",
    help="For a pipeline folder: NAME:tp=N shards it at TP degree N, NAME:whole copies it, NAME:skip leaves it out "
    "(default: transformers and text encoders over 16 GiB sharded, the rest copied). Repeatable.",
)
@click.option(
    "--keep-layers",
    "keep_layers",
    multiple=True,
    metavar="NAME:K",
    help="For a pipeline folder: keep the first K decoder layers of text encoder NAME and leave out the rest and its "
    "head; NAME:all keeps everything (default: what the pipeline documents it reads). Repeatable.",
)
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it is a preshard checkpoint.")
@click.option("--wait", is_flag=True, help="Wait for another conversion into OUTPUT to finish instead of failing.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Resolve source (Hub: headers only), plan and mesh; print per-rank bytes, output size, free space and a "
    "time estimate (page cache, disk and CPU measured just now); write nothing.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Local processes converting in parallel (at most --tp; several hosts: torchrun -m preshard.torchrun_convert).",
)
@_output_options
@click.version_option(__version__, "--version", prog_name="convert-checkpoint")
@user_errors
def convert_checkpoint_command(
    source, output, tp, cp, ring, ulysses, order, plan, dtype, subfolder, revision, token, component_choices,
    keep_layers, overwrite, wait, dry_run, workers, as_json, quiet, progress, loras, quantize, model_class,
):  # fmt: skip
    """Slice SOURCE (.safetensors file, weights folder, Hub repo id or s3:// URL) into per-rank shards in OUTPUT.

    Re-running a finished conversion with the same source, plan, mesh and dtype does nothing and exits 0
    ("already converted"); an interrupted one resumes, keeping what it had written.
    """
    from preshard.converter.convert import ConversionOutcome, convert_checkpoint, resolve_mesh

    progress = _progress(progress, quiet)
    from preshard.converter.pipeline_folder import is_hub_pipeline_id, is_pipeline_folder

    if subfolder is None and is_pipeline_folder(source):
        if model_class:
            raise UsageError("--model-class is not supported on a pipeline folder; use it with --subfolder NAME")
        _convert_pipeline_folder(
            source, output, tp, cp, ring, ulysses, order, plan, dtype, revision, component_choices, keep_layers,
            overwrite, wait, dry_run, workers, as_json, quiet, progress, loras, quantize,
        )  # fmt: skip
        return
    hub_pipeline = dict(revision=revision, token=token)  # a Hub repo that is a diffusers pipeline: converted whole
    if subfolder is None and (component_choices or keep_layers) and is_hub_pipeline_id(source):
        _convert_pipeline_folder(
            source, output, tp, cp, ring, ulysses, order, plan, dtype, None, component_choices, keep_layers,
            overwrite, wait, dry_run, workers, as_json, quiet, progress, loras, quantize, hub=hub_pipeline,
        )  # fmt: skip
        return
    if component_choices or keep_layers:
        raise UsageError("--component and --keep-layers apply to a pipeline folder (with model_index.json); drop them")
    if dry_run:
        from preshard.tools.dry_run import dry_run as plan_dry_run
        from preshard.tools.dry_run import dry_run_json, dry_run_text

        mesh = resolve_mesh(None, tp, cp, ring, ulysses, order)
        with _hub_progress(progress):
            report = plan_dry_run(
                source, output, mesh=mesh, plan=plan, dtype=dtype, subfolder=subfolder, revision=revision,
                token=token, overwrite=overwrite, loras=loras, start_seconds=_start_seconds(), quantize=quantize,
                model_class=model_class,
            )  # fmt: skip
        _emit(dry_run_json(report), dry_run_text(report), as_json, quiet)
        if report.space_error:
            _fail(report.space_error)
        return
    from preshard.tools.inspect import outcome_line

    started = time.perf_counter()
    outcome = ConversionOutcome()
    with _hub_progress(progress):
        try:
            manifest = convert_checkpoint(
                source, output, tp=tp, cp=cp, ring=ring, ulysses=ulysses, order=order, plan=plan, dtype=dtype,
                subfolder=subfolder, revision=revision, token=token, overwrite=overwrite, wait=wait,
                progress=progress, workers=workers, loras=loras, outcome=outcome, quantize=quantize,
                model_class=model_class,
            )  # fmt: skip
        except PipelineRepoError:  # raised before anything is written: the repo is a whole pipeline
            if model_class:
                raise UsageError(
                    "--model-class is not supported on a pipeline folder; use it with --subfolder NAME"
                ) from None
            _convert_pipeline_folder(
                source, output, tp, cp, ring, ulysses, order, plan, dtype, None, component_choices, keep_layers,
                overwrite, wait, dry_run, workers, as_json, quiet, progress, loras, quantize, hub=hub_pipeline,
            )  # fmt: skip
            return
    seconds = time.perf_counter() - started
    data = {"command": "convert", "status": outcome.status, **_manifest_summary(manifest, output)}
    data |= {"kept_tensors": outcome.kept_tensors, "kept_bytes": outcome.kept_bytes, "seconds": round(seconds, 3)}
    _emit(data, outcome_line(manifest, output, outcome), as_json, quiet)


def _convert_pipeline_folder(
    source, output, tp, cp, ring, ulysses, order, plan, dtype, revision, component_choices, keep_layers, overwrite,
    wait, dry_run, workers, as_json, quiet, progress, loras, quantize, hub: dict | None = None,
) -> None:  # fmt: skip
    """convert-checkpoint on a pipeline folder (or, `hub` given: {revision, token}, a Hub pipeline repo): every
    component in one conversion (converter/pipeline_folder.py)."""
    from preshard.converter.pipeline_folder import convert_pipeline

    for given, option in (
        (dry_run, "--dry-run"),
        (loras, "--lora"),
        (revision, "--revision"),
        (quantize, "--quantize"),
    ):
        if given:
            raise UsageError(f"{option} is not supported on a pipeline folder; use it with --subfolder NAME")
    started = time.perf_counter()
    outcomes: dict = {}
    record = convert_pipeline(
        source, output, tp=tp, cp=cp, ring=ring, ulysses=ulysses, order=order, components=component_choices,
        plan=plan, dtype=dtype, overwrite=overwrite, wait=wait, progress=progress, workers=workers, outcomes=outcomes,
        keep_layers=keep_layers, **(hub or {}),
    )  # fmt: skip
    seconds = time.perf_counter() - started
    components = {
        name: c.to_dict() | ({"status": outcomes[name].status} if name in outcomes else {})
        for name, c in record.components.items()
    }
    data: dict[str, object] = {"command": "convert", "output": str(output), "pipeline": record.pipeline_class}
    data["mesh"] = record.mesh
    data |= {"components": components, "seconds": round(seconds, 3)}
    text = "\n".join(
        [f"pipeline {record.pipeline_class} in {output}:"]
        + [
            f"  {name}: {c.treatment}"
            + (f" at tp={c.tp} ({outcomes[name].status})" if name in outcomes else "")
            + (f", layers 0-{c.left_out.keep_layers - 1} of {c.left_out.layers} kept" if c.left_out else "")
            for name, c in record.components.items()
        ]
    )
    _emit(data, text, as_json, quiet)


@click.group(cls=Group, context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.version_option(__version__, "--version", prog_name="preshard")
def main() -> None:
    """preshard: pre-sharded checkpoints for tensor x context parallel inference."""


main.add_command(convert_checkpoint_command, name="convert")


@main.command(epilog=EXIT_CODES_HELP)
@click.argument("checkpoint", type=click.Path(path_type=str))
@_hub_options("CHECKPOINT")
@_output_options
@user_errors
def inspect(checkpoint, subfolder, revision, token, as_json, quiet, progress):
    """Print the provenance, mesh, data files and the bytes each rank reads.

    CHECKPOINT is a converted folder or a Hub repo id holding one (only its manifest.json is downloaded), or a
    converted pipeline folder (each component, its treatment and checks).
    """
    from preshard.tools.inspect import (
        inspect_data,
        inspect_pipeline,
        inspect_table,
        read_checkpoint_manifest,
        read_pipeline,
    )

    record = read_pipeline(checkpoint) if not (subfolder or revision) else None
    if record is not None:  # a converted pipeline folder: each component, its treatment and checks
        data, text = inspect_pipeline(checkpoint, record)
        return _emit({"command": "inspect", **data}, text, as_json, quiet)
    with _hub_progress(_progress(progress, quiet)):
        manifest = read_checkpoint_manifest(checkpoint, subfolder=subfolder, revision=revision, token=token)
    _emit({"command": "inspect", **inspect_data(manifest)}, inspect_table(manifest), as_json, quiet)


@main.command(name="verify", epilog=EXIT_CODES_HELP)
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--source", default=None, help="Also compare every tensor with this source checkpoint, bit for bit.")
@_hub_options("--source")
@_output_options
@user_errors
def verify_command(checkpoint, source, subfolder, revision, token, as_json, quiet, progress):
    """Check a converted checkpoint: manifest, files, checksums, framing, .metadata, config (and the source).

    A converted pipeline folder: its record's seal, every file it lists (size and xxh3_128), and each sharded
    component as a checkpoint.

    Prints one line per problem and exits 1 if anything is wrong; exits 0 with a one-line summary if not
    (with --quiet: the problems only).
    """
    from preshard.tools.verify import verify_folder

    progress = _progress(progress, quiet)
    with _hub_progress(progress):
        result = verify_folder(
            checkpoint, source=source, subfolder=subfolder, revision=revision, token=token, progress=progress
        )
    if as_json:
        click.echo(json.dumps({"command": "verify", **result.to_dict()}, indent=1))
    else:
        for line in result.report_lines():
            click.echo(line)
        if not quiet:
            click.echo(result.summary())
    if not result.ok:
        sys.exit(EXIT_PROBLEMS)


@main.command(name="check", epilog=EXIT_CODES_HELP)
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--source", required=True, help="The unsharded checkpoint CHECKPOINT was converted from.")
@click.option(
    "--inputs", default=None, metavar="FILE",
    help="The forward's inputs: a .safetensors or torch file of named tensors (default: seeded, from the forward).",
)  # fmt: skip
@click.option(
    "--model-class", "model_class", default=None, metavar="MODULE:CLASS",
    help="The model's class where it is not in diffusers or transformers (as at conversion).",
)  # fmt: skip
@click.option("--tolerance", type=click.FloatRange(min=0), default=None, help="Share of each output's largest |value|.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the inputs built from the forward.")
@click.option("--device", default=None, help="Where the sharded model runs (default as load_sharded; reference: CPU).")
@click.option("--result-file", "result_file", default=None, hidden=True)
@_output_options
@user_errors
def check_command(
    checkpoint, source, inputs, model_class, tolerance, seed, device, result_file, as_json, quiet, progress
):  # fmt: skip
    """Compare the sharded CHECKPOINT with the unsharded --source on the same inputs, output by output.

    Runs a torchrun job of the checkpoint's world size (or runs as one rank of yours: torchrun ... -m preshard
    check ...). Prints the max difference per output; exits 0 within tolerance, 1 beyond.
    """
    from preshard.process import under_torchrun
    from preshard.tools.check import TOLERANCE, check_conversion, launch_check, world_size_of, write_result

    progress = _progress(progress, quiet)
    tolerance = TOLERANCE if tolerance is None else tolerance
    if under_torchrun() or world_size_of(checkpoint) == 1:
        result = check_conversion(
            checkpoint, source, inputs=inputs, model_class=model_class, tolerance=tolerance, seed=seed, device=device,
            progress=progress,
        )  # fmt: skip
        if not result.reported_here:
            return
        if result_file is not None:  # launched by the command below: it reports
            write_result(result, result_file)
            return
    else:
        args = ["--source", source, "--tolerance", repr(tolerance), "--seed", str(seed)]
        for option, value in (("--inputs", inputs), ("--model-class", model_class), ("--device", device)):
            args += [option, value] if value is not None else []
        args += [] if progress is None else ["--progress" if progress else "--no-progress"]
        result = launch_check(checkpoint, args, progress=progress)
    _emit({"command": "check", **result.to_dict()}, "\n".join(result.lines()), as_json, quiet and result.ok)
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
@_hub_options("CHECKPOINT")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it is a preshard checkpoint.")
@click.option("--wait", is_flag=True, help="Wait for another conversion into OUTPUT to finish instead of failing.")
@click.option(
    "--dry-run", is_flag=True, help="Check the new mesh and OUTPUT; print sizes, free space and a time estimate."
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=1, show_default=True,
    help="Local processes writing the new data files in parallel (at most --tp).",
)  # fmt: skip
@_output_options
@user_errors
def reshard_command(
    checkpoint, output, tp, cp, ring, ulysses, order, subfolder, revision, token, overwrite, wait, dry_run, workers,
    as_json, quiet, progress,
):  # fmt: skip
    """Write CHECKPOINT (a converted folder or Hub repo id) for another mesh into OUTPUT; no source needed.

    CP options left out keep the checkpoint's. The same TP degree (a CP-only change) links the data files and
    writes only a new manifest.
    """
    from preshard.tools.inspect import summary_line

    progress = _progress(progress, quiet)
    hub = {"subfolder": subfolder, "revision": revision, "token": token}
    mesh = {"tp": tp, "cp": cp, "ring": ring, "ulysses": ulysses, "order": order}
    if dry_run:
        from preshard.tools.dry_run import write_dry_run_json, write_dry_run_text
        from preshard.tools.reshard import reshard_dry_run

        with _hub_progress(progress):
            report = reshard_dry_run(
                checkpoint, output, **mesh, **hub, overwrite=overwrite, start_seconds=_start_seconds()
            )
        _emit(write_dry_run_json(report), write_dry_run_text(report), as_json, quiet)
        if report.space_error:
            _fail(report.space_error)
        return
    from preshard.tools.reshard import reshard_checkpoint

    started = time.perf_counter()
    with _hub_progress(progress):
        manifest = reshard_checkpoint(
            checkpoint, output, **mesh, **hub, overwrite=overwrite, wait=wait, progress=progress, workers=workers
        )
    data = {"command": "reshard", "input": checkpoint, **_manifest_summary(manifest, output)}
    data["seconds"] = round(time.perf_counter() - started, 3)
    _emit(data, summary_line(manifest, output), as_json, quiet)


@main.command(name="unshard", epilog=EXIT_CODES_HELP)
@click.argument("checkpoint")
@click.argument("output", type=click.Path(path_type=str))
@_hub_options("CHECKPOINT")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it is a safetensors checkpoint folder.")
@click.option("--wait", is_flag=True, help="Wait for another run writing OUTPUT to finish instead of failing.")
@click.option(
    "--dry-run", is_flag=True, help="Check CHECKPOINT and OUTPUT; print sizes, free space and a time estimate."
)
@_output_options
@user_errors
def unshard_command(checkpoint, output, subfolder, revision, token, overwrite, wait, dry_run, as_json, quiet, progress):
    """Rebuild the source safetensors checkpoint of CHECKPOINT in OUTPUT, bit for bit, in its own layout.

    Same file names, headers and index as the source, and config.json. Refused for a checkpoint converted with
    a --dtype that lost precision.
    """
    from preshard.units import human_bytes, plural

    progress = _progress(progress, quiet)
    hub = {"subfolder": subfolder, "revision": revision, "token": token}
    if dry_run:
        from preshard.tools.dry_run import write_dry_run_json, write_dry_run_text
        from preshard.tools.unshard import unshard_dry_run

        with _hub_progress(progress):
            report = unshard_dry_run(checkpoint, output, **hub, overwrite=overwrite, start_seconds=_start_seconds())
        _emit(write_dry_run_json(report), write_dry_run_text(report), as_json, quiet)
        if report.space_error:
            _fail(report.space_error)
        return
    from preshard.tools.unshard import unshard_checkpoint

    started = time.perf_counter()
    with _hub_progress(progress):
        files = unshard_checkpoint(checkpoint, output, **hub, overwrite=overwrite, wait=wait, progress=progress)
    sizes = {f.name: f.stat().st_size for f in files}
    data = {"command": "unshard", "input": checkpoint, "output": str(output), "status": "unsharded"}
    data |= {"files": [{"name": n, "size": s} for n, s in sizes.items()], "bytes": sum(sizes.values())}
    data["seconds"] = round(time.perf_counter() - started, 3)
    size = human_bytes(sum(sizes.values()))
    text = f"wrote {output}: {plural(len(files), 'file')}, {size}; every file matches the source"
    _emit(data, text, as_json, quiet)


@main.command(name="plan", epilog=EXIT_CODES_HELP)
@click.argument("source")
@click.option("--devices", type=click.IntRange(min=1), default=None, help="Devices in the job (default: TP alone).")
@click.option(
    "--device-memory", type=click.FloatRange(min=0, min_open=True), default=None, help="Memory of one device, GiB."
)
@click.option(
    "--plan", "plan", default=None,
    help="Built-in plan name, JSON plan file, or auto (inferred from the model's modules); default: from config.json.",
)  # fmt: skip
@click.option("--dtype", default=None, help="Plan for a cast: bf16, fp16 or fp32 (default: keep each dtype).")
@click.option(
    "--component",
    "component_choices",
    multiple=True,
    metavar="NAME:CHOICE",
    help="For a pipeline folder, as convert-checkpoint takes it: NAME:tp=N, NAME:whole or NAME:skip. Repeatable.",
)
@click.option(
    "--keep-layers",
    "keep_layers",
    multiple=True,
    metavar="NAME:K",
    help="For a pipeline folder, as convert-checkpoint.",
)
@click.option(
    "--show-plan", "show_plan", type=click.Path(dir_okay=False), default=None,
    help="Also write the plan used (built-in, the class's _tp_plan or inferred) as an editable plan file.",
)  # fmt: skip
@click.option(
    "--check", "check", is_flag=True, default=False,
    help="Prove the plan instead: one block of config.json's model, random weights, run sharded at --tp N on N "
    "gloo ranks against the unsharded block; exits 0 within tolerance, 1 beyond. Reads config.json only.",
)  # fmt: skip
@click.option("--tp", type=click.IntRange(min=1), default=None, help="With --check: the TP degree to check.")
@click.option(
    "--model-class", "model_class", default=None, metavar="MODULE:CLASS",
    help="With --check: the model's class where it is not in diffusers or transformers (as at conversion).",
)  # fmt: skip
@click.option(
    "--inputs", "inputs", default=None, metavar="FILE",
    help="With --check: the forward's inputs, as preshard check --inputs (default: seeded, from the forward).",
)  # fmt: skip
@_hub_options()
@_output_options
@user_errors
def plan_command(
    source, devices, device_memory, plan, dtype, component_choices, keep_layers, show_plan, check, tp, model_class,
    inputs, subfolder, revision, token, as_json, quiet, progress,
):  # fmt: skip
    """Which TP x CP meshes fit: per-rank weights, load reads and disk, from safetensors headers only.

    SOURCE is a local checkpoint or a Hub repo id (headers read with ranged requests; no weights downloaded).
    Every TP degree the plan allows up to --devices is listed, with every ring x ulysses split of the remaining
    devices. Weights only: activations and the compiler's workspace come on top.
    """
    from preshard.converter.pipeline_folder import is_pipeline_folder
    from preshard.tools.planner import plan_json, plan_meshes, plan_table

    if check or tp is not None or model_class is not None or inputs is not None:
        _plan_check(source, check, tp, plan, model_class, inputs, subfolder, revision, as_json, quiet, progress)
        return
    if subfolder is None and is_pipeline_folder(source):
        from preshard.tools.pipeline_plan import pipeline_plan_json, pipeline_plan_table, plan_pipeline_job

        if devices is None or plan is not None or show_plan is not None:
            raise UsageError(
                "on a pipeline folder, pass --devices N (and no --plan or --show-plan; use --subfolder NAME for those)"
            )
        job = plan_pipeline_job(
            source, devices=devices, device_memory_gib=device_memory, dtype=dtype, components=component_choices,
            keep_layers=keep_layers,
        )  # fmt: skip
        _emit({"command": "plan", **pipeline_plan_json(job)}, pipeline_plan_table(job), as_json, quiet)
        return
    if component_choices or keep_layers:
        raise UsageError("--component and --keep-layers apply to a pipeline folder (with model_index.json); drop them")
    with _hub_progress(bool(progress) and not quiet):  # headers only: bars only when asked for
        report = plan_meshes(
            source, devices=devices, device_memory_gib=device_memory, plan=plan, dtype=dtype, subfolder=subfolder,
            revision=revision, token=token,
        )  # fmt: skip
    data, text = {"command": "plan", **plan_json(report)}, plan_table(report)
    if show_plan is not None:
        from preshard.tools.show_plan import resolved_plan, write_plan_file

        chosen = resolved_plan(source, plan=plan, subfolder=subfolder, revision=revision, token=token)
        data["plan_file"] = str(write_plan_file(chosen, show_plan))
        text += f"\nwrote the plan {chosen.name} to {show_plan}: edit it and pass --plan {show_plan}"
    _emit(data, text, as_json, quiet)


def _plan_check(source, check, tp, plan, model_class, inputs, subfolder, revision, as_json, quiet, progress) -> None:
    """`preshard plan SRC --check --tp N`: the plan proven on one block (`tools.plan_check`)."""
    if not check:
        raise UsageError("--tp, --model-class and --inputs on preshard plan go with --check; add --check or drop them")
    if tp is None:
        raise UsageError("--check needs the TP degree to check: add --tp N (e.g. --tp 2)")
    if revision is not None:
        raise UsageError("--check reads a local folder's config.json; drop --revision (download the config first)")
    from preshard.tools.plan_check import check_plan

    result = check_plan(
        source,
        tp=tp,
        plan=plan,
        model_class=model_class,
        subfolder=subfolder,
        inputs=inputs,
        progress=_progress(progress, quiet),
    )
    _emit({"command": "plan", **result.to_dict()}, "\n".join(result.lines()), as_json, quiet and result.ok)
    if not result.ok:
        sys.exit(EXIT_PROBLEMS)


@main.command(epilog=EXIT_CODES_HELP)
@click.option("--tp", type=click.IntRange(min=1), default=2, show_default=True, help="Tensor-parallel degree.")
@click.option("--ring", type=click.IntRange(min=1), default=1, show_default=True, help="Ring-attention degree.")
@click.option("--ulysses", type=click.IntRange(min=1), default=2, show_default=True, help="Ulysses degree.")
@click.option("--seq-len", type=click.IntRange(min=3), default=37, show_default=True, help="Packed sequence rows.")
@click.option("--workdir", type=click.Path(path_type=str), default=None, help="Keep the files here (default: temp).")
@_output_options
@user_errors
def demo(tp, ring, ulysses, seq_len, workdir, as_json, quiet, progress):
    """Convert an embedded MiniMax-H3 example and run it sharded under torchrun on the CPU.

    Each step is one line (--progress adds nothing: the steps are the progress).
    """
    from preshard.demo import run_demo

    echo = click.echo if not (quiet or as_json) else (lambda line: None)
    result = run_demo(tp=tp, ring=ring, ulysses=ulysses, seq_len=seq_len, workdir=workdir, echo=echo)
    if as_json:
        click.echo(json.dumps({"command": "demo", **result}, indent=1))


if __name__ == "__main__":
    main()
