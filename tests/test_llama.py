"""Chapter 19: the Llama-style decoder-only model equals Hugging Face's LlamaForCausalLM
(weights copied, RoPE rows reordered), with and without the cache; generation, conversion
and bad inputs."""

import pytest
import torch

from transformer.modern.llama import (
    Llama,
    LlamaConfig,
    from_hf_state_dict,
    generate,
    hf_config_dict,
    to_hf_state_dict,
)


def _hf():
    "Hugging Face's transformers, imported by the tests that compare with it (about 3 s: not at collection)."
    return pytest.importorskip("transformers")


def _random(seed, **overrides):
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.preset("tiny", **overrides)).eval()
    with torch.no_grad():                  # sharp attention: a wrong rotation would show
        for layer in model.layers:
            layer.attention.w_q.weight.mul_(8)
            layer.attention.w_k.weight.mul_(8)
    return model


def _twin(model):
    transformers = _hf()
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_config_dict(model.config))).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    return hf


CONFIGS = [dict(), dict(tie_embeddings=True), dict(g=4), dict(g=1, n_layers=3),
           dict(d_k=8, rope_base=500000.0, norm_eps=1e-6)]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", CONFIGS)
def test_logits_equal_llama_for_causal_lm(overrides):
    ours = _random(0, **overrides)
    hf = _twin(ours)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("overrides", CONFIGS[:3])
def test_cached_decoding_equals_hf_cached_and_full(overrides):
    ours = _random(2, **overrides)
    hf = _twin(ours)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = hf(ids).logits
        caches = ours.new_caches(20)
        mine = [ours(ids[:, :4], caches)] + [ours(ids[:, t:t + 1], caches)
                                             for t in range(4, 20)]
        out = hf(ids[:, :4], use_cache=True)
        theirs = [out.logits]
        for t in range(4, 20):
            out = hf(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            theirs.append(out.logits)
    mine, theirs = torch.cat(mine, 1), torch.cat(theirs, 1)
    assert (mine - theirs).abs().max() < 1e-5
    assert (mine - full).abs().max() < 1e-5


@pytest.mark.slow
def test_without_the_row_reordering_the_models_differ():
    ours = _random(4)
    hf = _twin(ours)
    state = to_hf_state_dict(ours)
    for i in range(ours.config.n_layers):   # load our interleaved rows as they are
        attention = ours.layers[i].attention
        state[f"model.layers.{i}.self_attn.q_proj.weight"] = attention.w_q.weight
        state[f"model.layers.{i}.self_attn.k_proj.weight"] = attention.w_k.weight
    hf.load_state_dict(state)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() > 1e-2


@pytest.mark.slow
def test_generate_equals_hf_greedy_and_the_no_cache_loop():
    ours = _random(6, g=1)
    hf = _twin(ours)
    prompt = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(7))
    tokens = generate(ours, prompt, 12)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=12, min_new_tokens=12, do_sample=False)
        slow = prompt
        for _ in range(12):
            slow = torch.cat([slow, ours(slow)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, theirs) and torch.equal(tokens, slow)


@pytest.mark.slow
def test_generate_stops_rows_at_eos():
    ours = _random(8)
    prompt = torch.randint(0, 256, (3, 3), generator=torch.Generator().manual_seed(9))
    free = generate(ours, prompt, 10)
    eos = int(free[0, 5])                          # the token row 0 makes at its third step
    out = generate(ours, prompt, 10, eos_id=eos)
    assert torch.equal(out[0, :6], free[0, :6]) and (out[0, 5:] == eos).all()
    for row in range(3):                           # after its first eos, a row is all eos
        hits = (out[row, 3:] == eos).nonzero()
        if len(hits):
            assert (out[row, 3 + hits[0, 0]:] == eos).all()


def test_hf_round_trip_and_plain_tensors():
    ours = _random(10, g=2)
    state = to_hf_state_dict(ours)
    assert all(type(t) is torch.Tensor and not t.requires_grad for t in state.values())
    back = from_hf_state_dict(ours.config, state)
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_package_does_not_import_transformers():
    import transformer.modern.llama as module
    source = open(module.__file__).read()
    assert "import transformers" not in source and "from transformers" not in source


@pytest.mark.slow
def test_parameter_counts_of_the_presets():
    for name, expected in (("7b", 6_738_415_616), ("70b", 68_976_648_192)):
        with torch.device("meta"):
            model = Llama(LlamaConfig.preset(name))
        assert sum(p.numel() for p in model.parameters()) == expected
    tied = Llama(LlamaConfig.preset("tiny", tie_embeddings=True))
    assert tied.output.weight is tied.embed.weight


@pytest.mark.parametrize("make, message", [
    (lambda: LlamaConfig.preset("huge"), "unknown preset 'huge'"),
    (lambda: LlamaConfig(d_model=64, h=4, g=3), "h=4 query heads cannot be split into g=3"),
    (lambda: LlamaConfig(d_model=60, h=8), "d_model=60 is not divisible by h=8"),
    (lambda: LlamaConfig(d_model=60, h=4), "d_k=15 must be even"),
    (lambda: LlamaConfig(vocab_size=0), "vocab_size=0"),
])
def test_bad_configs(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_calls():
    model = Llama(LlamaConfig.preset("tiny"))
    with pytest.raises(ValueError, match="ids must be a \\(B, T\\) tensor"):
        model(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="ids must be a \\(B, T\\) tensor"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="got 1 caches for 2 layers"):
        model(torch.zeros(1, 3, dtype=torch.long), model.new_caches()[:1])
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 0)
