"""One line to the user on stderr, as every command says it: a note, a warning, an error."""
from __future__ import annotations

import click


def note(msg: str) -> None:
    click.echo(f"profinfer: {msg}", err=True)


def warn(msg: str) -> None:
    click.echo(f"profinfer: warning: {msg}", err=True)


def error(msg: str) -> None:
    click.echo(f"profinfer: error: {msg}", err=True)
