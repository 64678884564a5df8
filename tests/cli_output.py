"""What `rlmill ARGV` prints, run in this process: shared by the tests that read a command's output."""

from __future__ import annotations


def cli_output(*argv: str) -> str:
    """What `rlmill ARGV` prints. Not capsys: a Prefect flow run later in the process would log to
    its closed stream (Prefect's console handler keeps the sys.stdout it first saw)."""
    import contextlib
    import io

    from flows.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(list(argv))
    return out.getvalue()
