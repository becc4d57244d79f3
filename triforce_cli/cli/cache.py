"""`triforce cache list|clear`: the converted checkpoints and saved prefills the tool keeps on disk."""

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from triforce_cli.cli import options as o
from triforce_cli.cli.console import StdoutConsole, command_console, print_note
from triforce_cli.decoding.prompt_state import PREFIX_INDEX
from triforce_cli.decoding.tuning import remembered_tunings
from triforce_cli.runtime.measurements import tuning_folder
from triforce_cli.runtime.store import (
    LIMIT_VARIABLE,
    PROMPT_ENTRIES,
    cache_limit,
    compiled_folder,
    entries,
    human_size,
    models_folder,
    prompts_folder,
    remove,
)

cache_app = typer.Typer(
    help="List or clear the converted models, saved prefills, speed measurements and compiled steps kept on disk.",
    no_args_is_help=True,
)

PromptFolder = Annotated[
    Path | None,
    typer.Option(
        "--prompt-cache",
        parser=o.folder_path,
        metavar="DIR",
        help="Also this --prompt-cache folder [default: the cache's prompts/].",
    ),
]


def cache_folders(prompt_cache: Path | None) -> list[tuple[str, Path, str]]:
    """Each folder of cached entries, with the kind of entry it holds and the pattern of its entries' names (a
    prompt folder may be the user's: only the saved prefills in it are entries)."""
    folders = [
        ("model", models_folder(), "*"),
        ("prompt", prompts_folder(), PROMPT_ENTRIES),
        ("measurement", tuning_folder(), "*"),
        ("compiled step", compiled_folder(), "*"),  # torch inductor's caches of --compile's graphs
    ]
    if prompt_cache is not None:
        folders.append(("prompt", prompt_cache.expanduser(), PROMPT_ENTRIES))
    return folders


@cache_app.command("list")
def list_entries(prompt_cache: PromptFolder = None) -> None:
    """What is cached, least recently used first, and the size limit each folder is kept under. Measurements no run
    can use any more (their checkpoint's files are gone) are dropped first, as `triforce info` drops them."""
    with command_console() as err:
        remembered_tunings()
        limit = cache_limit()
        out = StdoutConsole()
        total = 0
        for kind, folder, names in cache_folders(prompt_cache):
            table = Table(title=Text(f"{kind}s in {folder}"), title_justify="left")
            table.add_column("entry", overflow="fold")
            table.add_column("size", justify="right")
            table.add_column("last used")
            for entry in entries(folder, names):
                total += entry.size
                table.add_row(Text(entry.path.name), human_size(entry.size), _when(entry.last_used))
            if table.row_count:
                out.print(table)
        limit_text = human_size(limit) if limit else "none"
        print_note(err, f"{human_size(total)} in all; each folder is kept under {limit_text} (${LIMIT_VARIABLE})")


@cache_app.command("clear")
def clear(
    models: Annotated[bool, typer.Option("--models", help="Clear converted models only.")] = False,
    prompts: Annotated[bool, typer.Option("--prompts", help="Clear saved prefills only.")] = False,
    measurements: Annotated[
        bool, typer.Option("--measurements", help="Forget the measured fastest set-ups only (measured again next run).")
    ] = False,
    compiled: Annotated[
        bool, typer.Option("--compiled", help="Clear compiled decode steps only (compiled again when next needed).")
    ] = False,
    prompt_cache: PromptFolder = None,
) -> None:
    """Remove cached entries (all of them unless --models, --prompts, --measurements or --compiled narrows it)."""
    with command_console() as err:
        freed = removed = 0
        chosen = {
            kind
            for kind, asked in (
                ("model", models),
                ("prompt", prompts),
                ("measurement", measurements),
                ("compiled step", compiled),
            )
            if asked
        }
        for kind, folder, names in cache_folders(prompt_cache):
            if chosen and kind not in chosen:
                continue
            for entry in entries(folder, names):
                remove(entry.path)
                freed += entry.size
                removed += 1
            if kind == "prompt":
                remove(folder / PREFIX_INDEX)  # names only the entries just removed
        print_note(err, f"removed {removed} entries, {human_size(freed)}")


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M")
