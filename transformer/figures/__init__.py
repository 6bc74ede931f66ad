"""Figures (appendix B): `viz`, the book's chart renderer (altair), and `plots`, matplotlib images
of your own runs and models. Both need the `figures` extra. Hand-written; the modules in it are
generated from book/."""
