"""The Transformer of "Attention Is All You Need", built chapter by chapter in the book under book/."""
__version__ = "0.1.0"
