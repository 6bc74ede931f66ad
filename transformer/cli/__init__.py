"""The command line (appendix C) and the benchmark (appendix D): `python -m transformer train |
translate | evaluate | export | attend | plot | bench | sweep`. Hand-written; the modules in it
are generated from book/."""
