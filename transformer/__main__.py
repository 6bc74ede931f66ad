"""`python -m transformer train|translate|evaluate`: the command line of `transformer.cli`."""
import sys

from transformer.cli import main

if __name__ == "__main__":
    sys.exit(main())
