"""Errors a user can cause, and how command-line entry points report them."""

from __future__ import annotations

import functools
import sys
from typing import Callable


class UserError(Exception):
    """Bad input from the user (config, paths, checkpoints). CLIs print one line and exit 2."""


def cli_entry(main: Callable[[list[str]], int]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI main: a UserError prints one line and exits 2; `--debug` shows the traceback."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv
        if debug:
            argv.remove("--debug")
        try:
            return main(argv) or 0
        except UserError as e:
            if debug:
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapper
