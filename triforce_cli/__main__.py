"""The `triforce` command (also `python -m triforce_cli`, as torchrun launches it)."""

import sys

from triforce_cli.interrupts import InterruptWatch, interrupted_exit_code
from triforce_cli.runtime.allocator import expandable_cuda_segments
from triforce_cli.runtime.store import keep_compiled_steps, unusable_cache_root


def main() -> None:
    """Run the command line; Ctrl-C or SIGTERM while torch and transformers import (seconds) is one line once the
    imports end, not a traceback or an abort inside a compiled module. Compiled steps are kept in the cache root
    (keep_compiled_steps), set before torch imports inductor; a GPU's allocator grows expandable segments
    (expandable_cuda_segments), set before torch allocates. A cache root that cannot be a folder is one line, before
    torch imports and tries to make its caches' folders in it."""
    if (reason := unusable_cache_root()) is not None:
        print(f"error: {reason}", file=sys.stderr)
        sys.exit(1)
    keep_compiled_steps()
    expandable_cuda_segments()
    with InterruptWatch(deferred=True) as watch:
        try:
            from triforce_cli.cli.app import app
        except BaseException:
            if not watch.seen:
                raise
    if watch.seen:
        print("error: interrupted", file=sys.stderr)
        sys.exit(interrupted_exit_code())
    app()


if __name__ == "__main__":
    main()
