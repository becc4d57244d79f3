"""The `triforce` command line: thin Typer commands over the library, and the Rich rendering of their results."""
