"""`python -m transformer train|translate|evaluate|bench|sweep`.

Hand-written: train/translate/evaluate are `transformer.cli` (appendix C); `bench` is
`transformer.bench` (appendix D) and `sweep` is `transformer.sweep` (appendix C.3), dispatched
here because cli.py must not import a later section.
"""
import sys

from transformer.cli import main as _cli_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from transformer.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["sweep"]:
        from transformer.sweep import main as sweep_main

        return sweep_main(argv[1:])
    return _cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
