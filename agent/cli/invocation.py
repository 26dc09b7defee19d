"""How the user ran gpuscope, for the commands its hints suggest: `gpuscope` when that name finds this
same program on PATH, otherwise the way it was started (`.venv/bin/gpuscope`, `python3 -m gpuscope`),
so that a hint can be pasted as it is printed."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Callable

PROGRAM = "gpuscope"
_OWN_MAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__main__.py")


def command_name(argv0: str | None = None, interpreter: str | None = None, *,
                 which: Callable[[str], str | None] = shutil.which) -> str:
    """The command that runs this gpuscope again, as the user would type it.

    ``argv0``: the script as started (``sys.argv[0]``: the console script's path as the shell ran it,
    or gpuscope's ``__main__.py`` under ``python -m gpuscope``); ``interpreter``: the interpreter as
    typed (``sys.orig_argv[0]``)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    interpreter = sys.orig_argv[0] if interpreter is None else interpreter
    if _same_file(_OWN_MAIN, argv0):
        return f"{shlex.quote(_interpreter(interpreter, which))} -m {PROGRAM}"
    if os.path.basename(argv0) != PROGRAM or _same_file(which(PROGRAM), argv0):
        return PROGRAM  # on PATH, or started some other way (embedded, a test runner): the plain name
    return shlex.quote(argv0)


def _interpreter(typed: str, which: Callable[[str], str | None]) -> str:
    """The interpreter as typed when that name finds it again (`python3`), else its full path."""
    if os.sep in typed or _same_file(which(typed), sys.executable):
        return typed
    return sys.executable


def _same_file(found: str | None, path: str) -> bool:
    try:
        return found is not None and os.path.samefile(found, path)
    except OSError:
        return False
