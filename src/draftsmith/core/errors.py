"""One base for every error draftsmith raises on purpose, so the CLI reports them all the same way.

Subclasses that describe bad input also derive from ValueError, which is what they were before there was
a common base; callers that catch ValueError keep working.
"""

from __future__ import annotations


class DraftsmithError(Exception):
    """An error the user can act on: the CLI prints its first line and exits with code 2."""

    #: Whether rerunning the same command can get past it (an interrupted run); the CLI says so only then.
    resumable: bool = False


class UsageError(DraftsmithError, ValueError):
    """Unusable arguments or inputs."""


def one_line(e: BaseException) -> str:
    """An error's message on one line (whitespace runs collapsed), or its type's name."""
    return " ".join(str(e).split()) or type(e).__name__
