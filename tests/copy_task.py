"""The copy task that the training, decoding and GPU tests learn, and a free port for their DDP
processes: one definition each, imported by the test files (tests/ is on pytest's import path)."""
import socket

import torch

from transformer.tokens import BOS, EOS


def copy_examples(n: int, seed: int = 0, vocab: int = 16, lo: int = 3, hi: int = 8,
                  reverse: bool = False) -> list[tuple[list[int], list[int]]]:
    """n pairs `(x EOS, BOS x EOS)`, x of lo to hi ids drawn from 4 .. vocab - 1 (the target
    reversed with `reverse`), from a `torch.Generator` seeded with `seed`: the same pairs in
    every process (the second regime's seed shift leaves a Generator's seed alone)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(4, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
        out.append((x + [EOS], [BOS] + (x[::-1] if reverse else x) + [EOS]))
    return out


def free_port() -> int:
    "A TCP port free on this machine now, for a process group's rendezvous."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
