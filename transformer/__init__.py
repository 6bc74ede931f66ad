"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), built chapter by chapter.

Hand-written (the rest of the package is generated from book/ by nbdev-export): the public API,
each name from the chapter that builds it. Chapter 9's `greedy_search` is the plain one (the whole
prefix at each step); the searches the package decodes with, cached and batched (`beam_search`,
`translate`, `evaluate`), are appendix D.2's, in `transformer.engine.fast`. Figures live in
`transformer.figures.viz` (imports altair) and `transformer.figures.plots` (matplotlib images of
runs and models).
"""
__version__ = "0.1.0"

from .data import DataError, UserError, load_multi30k, read_parallel                # 01 the corpus; every error a user can fix
from .tokens import BOS, EOS, PAD, UNK, Embeddings, Tokenizer, pad_batch, token_batches  # 01 tokens
from .attention import attention, scaled_dot_product_attention                      # 02, 03
from .heads import MultiHeadAttention                                                # 04
from .positions import LearnedPositionalEmbedding, PositionalEncoding, sinusoidal_encoding  # 05
from .blocks import Decoder, DecoderLayer, Encoder, EncoderLayer, FeedForward       # 06
from .masking import causal_mask, decoder_mask, padding_mask, teacher_forcing       # 07
from .model import PRESETS, Transformer, TransformerConfig                          # 07
from .training import TrainConfig                                                   # 08
from .decoding import PrefixDecoder, greedy_decode, greedy_search, length_penalty  # 09 (the plain search)
from .evaluation import bleu, bleu_lc_tok, chrf, score                              # 10
from .engine.loop import RunConfig, TrainResult, train                                     # E.2 the loop
from .engine.trained import TrainedModel, load                                             # E.1 a trained model
