"""`python -m preshard`: the `preshard` command, for environments where the console scripts are not on PATH."""

from preshard.cli import main

if __name__ == "__main__":
    main(prog_name="preshard")
