"""The `triforce` command (also `python -m triforce_cli`, as torchrun launches it)."""

import sys

from triforce_cli.interrupts import INTERRUPTED_EXIT_CODE, InterruptWatch


def main() -> None:
    """Run the command line; Ctrl-C while torch and transformers import (seconds) is one line, not a traceback."""
    with InterruptWatch() as watch:
        try:
            from triforce_cli.cli.app import app
        except BaseException:
            if not watch.seen:
                raise
            print("error: interrupted", file=sys.stderr)
            sys.exit(INTERRUPTED_EXIT_CODE)
    app()


if __name__ == "__main__":
    main()
