"""Masks: shapes, values, the True = may-attend convention, teacher forcing. The functions trust
their callers: ids are checked at the user's boundary (`Transformer`, the data)."""
import torch

from transformer.heads import MultiHeadAttention
from transformer.masking import causal_mask, decoder_mask, padding_mask, teacher_forcing
from transformer.tokens import BOS, EOS, PAD


def test_padding_mask():
    ids = torch.tensor([[5, 6, 7, PAD], [8, PAD, PAD, PAD]])
    m = padding_mask(ids)
    assert m.shape == (2, 1, 1, 4) and m.dtype == torch.bool
    assert m[:, 0, 0].tolist() == [[True, True, True, False], [True, False, False, False]]
    assert padding_mask(ids, pad_id=7)[0, 0, 0].tolist() == [True, True, False, True]


def test_causal_mask():
    m = causal_mask(4)
    assert m.shape == (1, 1, 4, 4) and m.dtype == torch.bool
    assert m[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert causal_mask(1).tolist() == [[[[True]]]]
    assert causal_mask(3, device="cpu").device.type == "cpu"


def test_decoder_mask_is_causal_and_padding():
    ids = torch.tensor([[BOS, 5, 6, PAD, PAD], [BOS, 5, 6, 7, 8]])
    m = decoder_mask(ids)
    assert m.shape == (2, 1, 5, 5)
    for b in range(2):
        for i in range(5):
            for j in range(5):
                assert m[b, 0, i, j].item() == (j <= i and ids[b, j].item() != PAD)
    assert m.any(-1).all()      # BOS first: no query row is fully masked


def test_teacher_forcing_shifts_by_one():
    tgt = torch.tensor([[BOS, 10, 11, 12, EOS], [BOS, 20, EOS, PAD, PAD]])
    tgt_in, tgt_out = teacher_forcing(tgt)
    assert tgt_in.tolist() == [[BOS, 10, 11, 12], [BOS, 20, EOS, PAD]]
    assert tgt_out.tolist() == [[10, 11, 12, EOS], [20, EOS, PAD, PAD]]
    assert torch.equal(tgt_in[:, 1:], tgt_out[:, :-1])   # the label at t is the input at t+1


def test_masks_drive_attention():
    "A masked key gets exactly zero weight; a fully masked query row gives zeros, not NaN."
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2).double().eval()
    ids = torch.tensor([[5, 6, PAD], [PAD, PAD, PAD]])
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    out, w = mha(x, x, x, padding_mask(ids), need_weights=True)
    assert (w[0, :, :, 2] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    out, w = mha(x, x, x, decoder_mask(torch.tensor([[5, 6, 7]])), need_weights=True)
    assert (w[0].triu(1) == 0).all()
