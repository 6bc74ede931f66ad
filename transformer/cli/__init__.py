"""The command line (appendix C), the benchmark (appendix D) and `export --web` (appendix I):
`python -m transformer train | translate | evaluate | export | attend | plot | bench | sweep`.
Hand-written; the modules in it are generated from book/."""
