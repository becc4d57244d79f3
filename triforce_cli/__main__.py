"""The `triforce` command (also `python -m triforce_cli`, as torchrun launches it)."""

import sys

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as shells report a Ctrl-C


def main() -> None:
    """Run the command line; Ctrl-C while torch and transformers import (seconds) is one line, not a traceback."""
    try:
        from triforce_cli.cli.app import app
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT_CODE)
    app()


if __name__ == "__main__":
    main()
