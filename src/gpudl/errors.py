"""The one exception type that means "the user asked for something we cannot do".

The CLI turns a `UserError` into a single line on stderr and exit status 2; anything
else is a bug and keeps its traceback. Messages repeat what was asked for and say the
fix, e.g. "train.batch_size must be >= 1, got -4: set --set train.batch_size=32".
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """Bad input from the user: a config, a path, a device, a checkpoint."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def unknown_name(what: str, name: str, choices: Iterable[str]) -> UserError:
    """An error for a failed lookup that lists every name that exists."""
    choices = sorted(choices)
    return UserError(f"unknown {what} {name!r}{did_you_mean(name, choices)}; choose one of: {', '.join(choices)}")
