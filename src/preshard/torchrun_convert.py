"""Conversion as one process of a torchrun job, for several hosts on a shared file system:

    torchrun --nproc-per-node P [--nnodes N --node-rank R --master-addr HOST] -m preshard.torchrun_convert \\
        SRC OUT --tp 8 [convert-checkpoint's other options]

Each process writes its share of the data files and the lowest rank commits; the result is byte-identical to a
single-process conversion (on one host, `convert-checkpoint ... --workers P` does the same).
"""

from __future__ import annotations

from preshard.cli import convert_checkpoint_command
from preshard.converter.parallel import run_under_torchrun

PROG = "python -m preshard.torchrun_convert"


def main(argv: list[str] | None = None) -> None:
    run_under_torchrun(lambda: convert_checkpoint_command.main(args=argv, prog_name=PROG), PROG)


if __name__ == "__main__":
    main()
