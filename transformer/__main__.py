"""`python -m transformer train|translate|evaluate|bench|sweep`.

Hand-written: train/translate/evaluate are `transformer.cli.commands` (appendix C); `bench` is
`transformer.cli.bench` (appendix D) and `sweep` is `transformer.cli.sweep` (appendix C.3), dispatched
here because commands.py must not import a later section.
"""
import sys

from transformer.cli.commands import main as _cli_main, report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] not in (["bench"], ["sweep"]):
        return _cli_main(argv)
    try:
        if argv[0] == "bench":
            from transformer.cli.bench import main as command
        else:
            from transformer.cli.sweep import main as command
        return command(argv[1:])
    except Exception as e:  # as cli.main: a user error in one line, a bug with its traceback
        return report(e, argv[0])


if __name__ == "__main__":
    sys.exit(main())
