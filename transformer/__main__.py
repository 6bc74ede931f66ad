"""`python -m transformer train|translate|evaluate|export|plot|attend|bench|sweep|prepare`.

Hand-written, the top of the package: the one module that imports every command. `train` is
`transformer.cli.train` (appendix C.1); translate, evaluate, export, plot and attend are
`transformer.cli.use` (C.2); both run through `transformer.cli.commands.run_command` (appendix C),
which parses the line and turns every error into one line. `bench` (`transformer.cli.bench`,
appendix D), `sweep` (`transformer.cli.sweep`, C.3) and `prepare` (`transformer.engine.corpus`,
A.1) have parsers of their own and are handed over before it runs.
"""
import codecs
import sys

from transformer.cli import train, use
from transformer.cli.commands import report, run_command


# the commands with parsers of their own, handed over before `run_command` parses the line
OWN_PARSERS = ("bench", "sweep", "prepare")


def commands() -> dict:
    """The commands `run_command` parses and runs: name -> function. Looked up at each call,
    so that a test may replace one. With `OWN_PARSERS`, every command `main` runs: the
    parser lists each in `python -m transformer --help` (tests/test_cli.py checks)."""
    return {"train": train.cmd_train, "translate": use.cmd_translate,
            "evaluate": use.cmd_evaluate, "export": use.cmd_export,
            "plot": use.cmd_plot, "attend": use.cmd_attend}


def utf8_output() -> None:
    """Write stdout and stderr in UTF-8, the encoding of every text file the package reads,
    where Python chose another: Windows gives output to a file or a pipe the locale's code
    page (cp1252), where `translate > out.txt` stopped with UnicodeEncodeError at a character
    it lacks (sentencepiece's ⁇ for an unknown piece) and wrote a file that `translate` and
    `evaluate --src-file` refuse as not UTF-8. A terminal keeps its encoding; what it cannot
    show becomes '?'."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        if codecs.lookup(encoding).name != "utf-8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(**({"errors": "replace"} if stream.isatty() else {"encoding": "utf-8"}))


def main(argv: list[str] | None = None) -> int:
    "Run `python -m transformer <command> ...`; returns the exit code."
    argv = sys.argv[1:] if argv is None else list(argv)
    utf8_output()
    if not argv or argv[0] not in OWN_PARSERS:
        return run_command(argv, commands())
    try:
        if argv[0] == "bench":
            from transformer.cli.bench import main as command
        elif argv[0] == "prepare":
            from transformer.engine.corpus import main as command
        else:
            from transformer.cli.sweep import main as command
        return command(argv[1:])
    except Exception as e:  # as run_command: a user error in one line, a bug with its traceback
        return report(e, argv[0])


if __name__ == "__main__":
    sys.exit(main())
