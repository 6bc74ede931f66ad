"""After 2017 (chapters 14-19.1): rotary positions, grouped-query attention, FlashAttention's
tiling, RMSNorm and SwiGLU, mixture of experts, a Llama-style decoder and the decoder-only
Transformer. Hand-written; the modules in it are generated from book/."""
