"""The engine (appendices A.1, D.2, E, F): a prepared corpus, the training loop, checkpoints,
devices and processes, the fast paths proved equal to the main line's code, the Python API for a
trained model (`transformer.load`). Hand-written; its modules are generated from book/."""
