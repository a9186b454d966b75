"""Command line: parses arguments and calls the library; every user error is one line and exit status 2."""

from __future__ import annotations

import errno
import functools
import sys

import click

from preshard.errors import PreshardError

EXIT_USAGE = 2


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def user_errors(fn):
    """Turn library errors into one line on stderr and exit status 2, with no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PreshardError as exc:
            _fail(str(exc))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                _fail(f"the disk is full ({exc.filename or 'while writing'}); free space and re-run to resume")
            _fail(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        except KeyboardInterrupt:
            _fail("interrupted; re-run the same command to resume")

    return wrapper


@click.command(name="convert-checkpoint", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("source", type=click.Path(path_type=str))
@click.argument("output", type=click.Path(path_type=str))
@click.option("--tp", type=int, required=True, help="Tensor-parallel degree.")
@click.option("--cp", type=int, default=None, help="Context-parallel degree (Ulysses unless --ring is given).")
@click.option("--ring", type=int, default=None, help="Ring-attention degree.")
@click.option("--ulysses", type=int, default=None, help="Ulysses degree.")
@click.option("--order", default=None, help="Mesh axis order, default tp,ring,ulysses (last varies fastest).")
@click.option("--plan", "plan", default=None, help="Built-in plan name or JSON plan file (default: from config.json).")
@click.option("--dtype", default=None, help="Cast floating tensors: bf16, fp16 or fp32 (default: keep each dtype).")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
def convert_checkpoint_command(source, output, tp, cp, ring, ulysses, order, plan, dtype, overwrite, quiet):
    """Slice SOURCE (.safetensors file or diffusers weights folder) into per-rank DCP shards in OUTPUT."""
    from preshard.converter.convert import convert_checkpoint
    from preshard.manifests.report import summary_line

    manifest = convert_checkpoint(
        source, output, tp=tp, cp=cp, ring=ring, ulysses=ulysses, order=order,
        plan=plan, dtype=dtype, overwrite=overwrite, progress=not quiet,
    )  # fmt: skip
    click.echo(summary_line(manifest, output))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """preshard: pre-sharded checkpoints for tensor x context parallel inference."""


main.add_command(convert_checkpoint_command, name="convert")


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=str))
@user_errors
def inspect(checkpoint):
    """Print the mesh, the data files and the bytes each rank reads."""
    from preshard.manifests.io import read_manifest
    from preshard.manifests.report import inspect_table

    click.echo(inspect_table(read_manifest(checkpoint)))


@main.command(name="verify")
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--source", default=None, help="Also compare every tensor with this source checkpoint, bit for bit.")
@click.option("--progress", is_flag=True, help="Show a progress bar.")
@user_errors
def verify_command(checkpoint, source, progress):
    """Check a converted checkpoint: files, checksums, chunk coverage, .metadata, config (and the source).

    Prints one line per problem and exits 1 if anything is wrong; exits 0 with a one-line summary if not.
    """
    from preshard.manifests.verify import verify_checkpoint

    result = verify_checkpoint(checkpoint, source=source, progress=progress)
    for line in result.report_lines():
        click.echo(line)
    click.echo(result.summary())
    if not result.ok:
        sys.exit(1)


@main.command()
@click.option("--tp", type=int, default=2, show_default=True, help="Tensor-parallel degree.")
@click.option("--ring", type=int, default=1, show_default=True, help="Ring-attention degree.")
@click.option("--ulysses", type=int, default=2, show_default=True, help="Ulysses degree.")
@click.option("--seq-len", type=int, default=37, show_default=True, help="Rows of the packed sequence.")
@click.option("--workdir", type=click.Path(path_type=str), default=None, help="Keep the files here (default: temp).")
@user_errors
def demo(tp, ring, ulysses, seq_len, workdir):
    """Convert an embedded MiniMax-H3 example and run it sharded under torchrun on the CPU."""
    from preshard.demo import run_demo

    run_demo(tp=tp, ring=ring, ulysses=ulysses, seq_len=seq_len, workdir=workdir, echo=click.echo)


if __name__ == "__main__":
    main()
