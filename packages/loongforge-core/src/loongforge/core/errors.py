"""Errors a user can cause, and how command-line entry points report them.

`cli_entry` keeps a terminal to LoongForge's own messages without changing the process for
anyone else: while the wrapped CLI runs, and only then, it hides the warnings in
`QUIET_NOTICES` (each matched by the module that warns, and by its message) and megatron's log
messages below ERROR; both are put back when the CLI returns. megatron-core is how the CLIs
train, not an API their user calls: its warnings (import-time notices that Transformer Engine
and Apex are not installed, deprecations of its own defaults and of the torch APIs it calls)
say nothing the user can act on. A user's own warnings, and those of every other library, show
as usual; `--debug` hides nothing and shows tracebacks.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import sys
import warnings
from typing import Callable, Iterator

# (module, message) regexes: what megatron-core warns, and torch's deprecation of the
# ShardedTensor that megatron's dist_checkpointing saves (warned from torch's own modules).
QUIET_NOTICES = (
    (r"megatron\.", ""),
    (r"torch\.distributed\.checkpoint\.", r"Please use DTensor instead and we are deprecating ShardedTensor"),
)


class UserError(Exception):
    """Bad input from the user (config, paths, checkpoints). CLIs print one line and exit 2."""


def os_error_message(e: OSError, command: str = "") -> str | None:
    """The one-line message for an OSError the user can fix (disk full, read-only file system,
    permission denied), naming the path where the error has one; None for any other OSError.
    `command` (the CLI's subcommand: train, convert, ...) picks the hint."""
    path = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    elsewhere = "pick another checkpoint.run_dir" if command == "train" else "use another directory"
    if e.errno == errno.ENOSPC:
        kept = "; saved checkpoints are untouched" if command == "train" else ""
        if not path:
            return f"no space left on device (free space or {elsewhere}){kept}"
        return f"no space left on device writing {path} (free space there or {elsewhere}){kept}"
    if e.errno == errno.EROFS:
        return f"{path or 'the target'} is on a read-only file system (remount it writable or {elsewhere})"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied: {path or '(no path given)'} (fix its permissions or ownership, or {elsewhere})"
    return None


@contextlib.contextmanager
def quiet_notices() -> Iterator[None]:
    """Hide QUIET_NOTICES and megatron's log messages below ERROR inside the block only."""
    log = logging.getLogger("megatron")
    level = log.level
    with warnings.catch_warnings():
        for module, message in QUIET_NOTICES:
            warnings.filterwarnings("ignore", message=message, module=module)
        log.setLevel(logging.ERROR)
        try:
            yield
        finally:
            log.setLevel(level)


def cli_entry(main: Callable[[list[str]], int]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI main: a UserError, or an OSError of `os_error_message` (disk full, read-only,
    permission denied), prints one line and exits 2; `--debug` shows the traceback. On return
    the process group and the accelerator are released if this call set them up (a caller that
    had them, such as a program calling `main` in process, keeps its own)."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        # what the caller already had (looked up, not imported: importing torch here would change
        # the process's warning filters outside `quiet_notices`)
        dist_mod, acc_mod = sys.modules.get("torch.distributed"), sys.modules.get("loongforge.core.accelerator.base")
        had_group = dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized()
        had_accelerator = acc_mod is not None and acc_mod.active_accelerator() is not None
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv
        if debug:
            argv.remove("--debug")
        try:
            with contextlib.nullcontext() if debug else quiet_notices():
                return main(argv) or 0
        except UserError as e:
            if debug:
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            message = None if debug else os_error_message(e, argv[0] if argv else "")
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            return 2
        finally:
            import torch.distributed as dist
            from loongforge.core.accelerator import release_accelerator

            if not had_group and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            if not had_accelerator:
                release_accelerator()

    return wrapper
