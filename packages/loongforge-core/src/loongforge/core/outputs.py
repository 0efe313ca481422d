"""Output directories: a command that writes a new directory never writes into a user's
non-empty one (every converter, exporter and preprocessor checks through this), and a derived
directory (an export, a tokenizer copy, a data cache) replaces the previous one only once it is
complete."""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from loongforge.core.errors import UserError


def require_new_dir(path) -> Path:
    """`path` as a Path, if it does not exist or is an empty directory; else a UserError."""
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: output directory exists and is not empty; choose a new one")
    return out


def new_sibling_dir(root) -> Path:
    """A new empty directory `.<name>.tmp-<pid>-<random>` beside `root` (made with the umask's
    permissions, which it keeps once renamed into place), for writers that may race another
    process writing the same `root`."""
    import secrets

    root = Path(root)
    while True:
        tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def write_once(root, write, existing):
    """A generated directory at `root`, written once: `write(tmp)` fills a new sibling that is
    renamed into place when complete and on disk (replacing nothing but an empty directory). If
    `root` is already there, or another process (a second rank) puts its copy in place first,
    `existing(root)` checks what is there and its value is returned; a failure leaves no
    temporary behind and `root` as it was."""
    import shutil

    from loongforge.core.checkpoint.layout import fsync_path, fsync_tree

    root = Path(root)

    def taken() -> bool:
        return os.path.lexists(root) and not (root.is_dir() and not root.is_symlink() and not any(root.iterdir()))

    if taken():
        return existing(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_sibling_dir(root)
    try:
        write(tmp)
        fsync_tree(tmp)
        try:
            os.rename(tmp, root)  # replaces an empty directory; fails on a non-empty one
        except OSError:
            if not taken():
                raise
            shutil.rmtree(tmp)  # another writer put its copy in place first
            return existing(root)
        fsync_path(root.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


_TEMPORARY = re.compile(r"^(?P<base>.+?)\.(?P<old>old\.)?tmp-(?P<pid>\d+)$")


@contextmanager
def replaced_dir(out) -> Iterator[Path]:
    """Build a directory in a temporary sibling `<out>.tmp-<pid>` (yielded, empty) and put it in
    place of `out` only once it is complete and on disk: a kill at any point leaves the old `out`
    or the new one, plus temporaries that `clean_stale_temporaries` removes."""
    from loongforge.core.checkpoint.layout import fsync_path, fsync_tree

    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_tree(tmp)
    if out.exists():
        old = out.with_name(f"{out.name}.old.tmp-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        fsync_path(out.parent)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
        fsync_path(out.parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temporaries(directory) -> list[str]:
    """Remove the temporaries (`<name>.tmp-<pid>`, `<name>.old.tmp-<pid>`) that processes no
    longer alive left in `directory`; an old copy whose replacement never landed is renamed back
    to `<name>`. Returns what was done, for the log."""
    done: list[str] = []
    d = Path(directory)
    if not d.is_dir():
        return done
    for p in sorted(d.iterdir()):
        m = _TEMPORARY.match(p.name)
        if m is None or int(m["pid"]) == os.getpid() or _alive(int(m["pid"])):
            continue
        base = d / m["base"]
        if m["old"] and not base.exists():
            p.rename(base)
            done.append(f"restored {base} (its replacement was interrupted)")
        elif p.is_dir():
            shutil.rmtree(p)
            done.append(f"removed the unfinished {p}")
        else:
            p.unlink()
            done.append(f"removed the unfinished {p}")
    return done
