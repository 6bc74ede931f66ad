"""The engine (appendices D, E and F): the training loop, checkpoints, devices and
processes, the fast paths proved equal to the main line's code, and the Python API for a trained
model (`transformer.load`). Hand-written; the modules in it are generated from book/."""
