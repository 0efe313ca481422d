"""Errors a user can cause, and how command-line entry points report them."""

from __future__ import annotations

import functools
import logging
import sys
import warnings
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
        else:
            # megatron-core warns at import about optional extras (apex, TE) that LoongForge
            # never uses; keep a user's terminal to our own messages.
            warnings.filterwarnings("ignore", module=r"megatron\.")
            logging.getLogger("megatron").setLevel(logging.ERROR)
        try:
            return main(argv) or 0
        except UserError as e:
            if debug:
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()

    return wrapper
