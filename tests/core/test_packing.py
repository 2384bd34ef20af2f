"""Padding-free forwards (`core/packing.py`): the rows packed into one sequence give the padded rows' log-probs,
entropies, statistics and gradients; rows or models that cannot be packed take the padded path, reported."""

import logging

import pytest
import torch

from trl_unified import compute_token_logprobs
from trl_unified.core import packing
from trl_unified.core.packing import PackedRows
from trl_unified.generation import fallbacks
from trl_unified.preference.trainer import preference_token_stats


def ragged_batch():
    """Left-padded prompts of 2-4 tokens, right-padded completions of 1-4 tokens: the online layout."""
    ids = torch.tensor(
        [
            [0, 0, 5, 6, 20, 21, 22, 23],
            [0, 7, 8, 9, 24, 25, 0, 0],
            [10, 11, 12, 13, 26, 0, 0, 0],
        ]
    )
    mask = (ids != 0).long()
    return ids, mask


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_packed_rows_by_hand():
    ids, mask = ragged_batch()
    packed = PackedRows.build(ids, mask, 4)
    assert packed.input_ids.tolist() == [[5, 6, 20, 21, 22, 23, 7, 8, 9, 24, 25, 10, 11, 12, 13, 26]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    # scored: columns 4-7 of row 0 (4 tokens), 4-5 of row 1, 4 of row 2; each predicted by the token before it
    assert packed.targets.tolist() == [20, 21, 22, 23, 24, 25, 26]
    assert packed.source.tolist() == [1, 2, 3, 4, 8, 9, 14]
    assert packed.rows.tolist() == [0, 0, 0, 0, 1, 1, 2] and packed.columns.tolist() == [0, 1, 2, 3, 0, 1, 0]
    values = torch.arange(1.0, 8.0)[None]
    assert packed.scatter(values).tolist() == [[1, 2, 3, 4], [5, 6, 0, 0], [7, 0, 0, 0]]
    holes = mask.clone()
    holes[0, 5] = 0
    assert PackedRows.build(ids, holes, 4) is None


@pytest.mark.parametrize("from_hidden_states", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padding_free_equals_padded_in_values_and_gradients(qwen2_model, from_hidden_states, temperature, monkeypatch):
    """A weighted loss with an entropy bonus under grad, the head in chunks of 3 positions (across rows)."""
    monkeypatch.setattr("trl_unified.core.lm_head._CHUNK_ELEMENTS", 3 * qwen2_model.config.vocab_size)
    ids, mask = ragged_batch()
    completion = mask[:, -4:]
    weights = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.0, 0.25, -0.75, 3.0], [1.5, -2.0, 1.0, 1.0]]) * completion
    options = dict(temperature=temperature, compute_entropy=True, entropy_requires_grad=True,
                   from_hidden_states=from_hidden_states)  # fmt: skip
    seen = []
    qwen2_model.model.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs["input_ids"].shape),
                                            with_kwargs=True)  # fmt: skip
    results = []
    for padding_free in (True, False):
        out = compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=padding_free, **options)
        ((out.logps * weights).sum() - 0.1 * (out.entropy * completion).sum()).backward()
        results.append((out, _grads(qwen2_model)))
    (packed, packed_grads), (padded, padded_grads) = results
    assert seen == [(1, 11), (1, 5), (1, 16), (3, 8)]  # the once-per-model check (rows 0-1, row 1), packed, padded
    torch.testing.assert_close(packed.logps * completion, padded.logps * completion, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.entropy * completion, padded.entropy * completion, rtol=1e-5, atol=1e-5)
    assert packed_grads.keys() == padded_grads.keys() and packed_grads["lm_head.weight"].abs().sum() > 0
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_padding_free_runs_one_row_of_real_tokens_and_keeps_statistics(qwen2_model):
    """The decoder sees one row of the 16 real tokens (no padding); the preference statistics come back per token."""
    seen = []
    qwen2_model.model.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs["input_ids"].shape),
                                            with_kwargs=True)  # fmt: skip
    ids, mask = ragged_batch()
    stats = preference_token_stats(with_sum_sq_probs=True)
    packed = compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=True, logits_stats=stats)
    assert seen[-1] == (1, 16)
    padded = compute_token_logprobs(qwen2_model, ids, mask, 4, logits_stats=stats)
    scored = mask[:, -4:].bool()
    for name in ("mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(packed.stats[name][scored], padded.stats[name][scored], rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.stats["is_top1"][scored], padded.stats["is_top1"][scored])
    assert not packed.stats["is_top1"][~scored].any() and (packed.logps[~scored] == 0).all()


def test_padding_free_auto_packs_only_rows_with_enough_padding(qwen2_model, monkeypatch):
    """`padding_free=None`: the ragged batch (8 of 24 slots padding) is packed; the same rows without padding, a
    call with position ids or with shared prompts are not. The values are the padded ones either way."""
    from trl_unified.core import logprobs

    packed = []
    original = logprobs._score_packed
    monkeypatch.setattr(logprobs, "_score_packed", lambda *a, **k: packed.append(a[2].shape) or original(*a, **k))
    ids, mask = ragged_batch()
    auto = compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=None)
    assert packed == [(3, 4)]
    padded = compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=False)
    scored = mask[:, -4:].bool()
    torch.testing.assert_close(auto.logps[scored], padded.logps[scored], rtol=1e-5, atol=1e-5)
    full = torch.ones_like(mask)
    dense = torch.randint(1, qwen2_model.config.vocab_size, ids.shape)
    compute_token_logprobs(qwen2_model, dense, full, 4, padding_free=None)
    one_pad = full.clone()
    one_pad[0, 0] = 0  # 1 of 24 slots: below PACKING_MIN_PADDING
    compute_token_logprobs(qwen2_model, dense, one_pad, 4, padding_free=None)
    compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=None, position_ids=(mask.cumsum(1) - 1).clamp(0))
    assert packed == [(3, 4)]
    assert logprobs.PACKING_MIN_PADDING == 0.1


def _spy_on_sdpa(monkeypatch):
    """Record the key length and mask of each call `segmented_sdpa` makes to transformers' sdpa."""
    packing.install_segmented_sdpa()
    calls, forward = [], packing._SDPA["forward"]

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((key.size(2), attention_mask is None))
        return forward(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(packing._SDPA, "forward", spy)
    return calls


def test_segmented_sdpa_equals_the_block_diagonal_mask_and_passes_other_calls_through(monkeypatch):
    """Each sequence's causal attention on its own equals sdpa with the block-diagonal causal mask; calls without
    the boundaries, or with a sliding window a sequence outgrows, go to transformers' sdpa with their mask."""
    calls = _spy_on_sdpa(monkeypatch)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 9, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, 2, 9, 8, generator=generator, requires_grad=True) for _ in range(2))
    bounds = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    segment = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 1, 4]))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    mask = (causal & (segment[:, None] == segment[None, :]))[None, None]
    out, _ = packing.segmented_sdpa(module, query, key, value, mask, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
    assert calls == [(4, True), (1, True), (4, True)]  # per sequence, no mask
    expected, _ = packing._SDPA["forward"](module, query, key, value, mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (query, key, value))
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (query, key, value)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the masked kernel: 5e-6 where 0 is exact
    calls.clear()
    packing.segmented_sdpa(module, query, key, value, mask)  # no boundaries
    packing.segmented_sdpa(module, query, key, value, mask, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds,
                           sliding_window=3)  # fmt: skip
    packing.segmented_sdpa(
        module, query[:, :, -1:], key, value, mask[:, :, -1:], cu_seq_lens_q=bounds, cu_seq_lens_k=bounds
    )  # fmt: skip  (one query over a cache: decoding)
    assert calls == [(9, False), (9, False), (9, False)]


def test_packed_forward_attends_per_sequence_also_under_gradient_checkpointing(qwen2_model, monkeypatch):
    """The packed forward runs sdpa once per row and layer without a mask, and so does the recomputation under
    gradient checkpointing (the boundaries travel in the layer's keyword arguments): the gradients equal the padded
    forward's."""
    calls = _spy_on_sdpa(monkeypatch)
    ids, mask = ragged_batch()
    if hasattr(qwen2_model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        qwen2_model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        qwen2_model.gradient_checkpointing_enable({"use_reentrant": False})
    qwen2_model.train()
    results = []
    for padding_free in (True, False):
        calls.clear()
        out = compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=padding_free)
        (out.logps * mask[:, -4:]).sum().backward()
        results.append((out.logps * mask[:, -4:], _grads(qwen2_model), list(calls)))
    (packed, packed_grads, packed_calls), (padded, padded_grads, padded_calls) = results
    layers = qwen2_model.config.num_hidden_layers
    # the check (rows 0-1 packed: 2 sequences), then the batch (3 sequences), forward and recomputation
    assert packed_calls[: 2 * layers] == [(6, True), (5, True)] * layers
    assert packed_calls[-6 * layers :] == [(6, True), (5, True), (5, True)] * 2 * layers
    assert all(length == 8 for length, _ in padded_calls)  # the padded rows: transformers' sdpa on (3, 8)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_rows_on_eager_attention_use_the_block_diagonal_mask(llama_model, monkeypatch):
    """Eager attention takes transformers' block-diagonal mask (never the per-sequence sdpa): packed equals padded."""
    calls = _spy_on_sdpa(monkeypatch)
    llama_model.set_attn_implementation("eager")
    ids, mask = ragged_batch()
    packed = compute_token_logprobs(llama_model, ids, mask, 4, padding_free=True)
    padded = compute_token_logprobs(llama_model, ids, mask, 4)
    completion = mask[:, -4:]
    torch.testing.assert_close(packed.logps * completion, padded.logps * completion, rtol=1e-5, atol=1e-5)
    assert packing._VERIFIED[llama_model] is True and calls == []


class _IgnoresPositions(torch.nn.Module):
    """A model whose forward drops `position_ids` and the sequence boundaries: packed rows would attend to each
    other."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("max_length_q", "max_length_k")}
        return self.inner(**kwargs)


def test_a_model_that_mixes_packed_rows_is_caught_and_runs_padded(qwen2_model, monkeypatch, caplog):
    monkeypatch.setattr(fallbacks, "_reported", set())
    model = _IgnoresPositions(qwen2_model)
    ids, mask = ragged_batch()
    with caplog.at_level(logging.INFO, logger="trl_unified.core.packing"):
        packed = compute_token_logprobs(model, ids, mask, 4, padding_free=True, from_hidden_states=False)
    padded = compute_token_logprobs(model, ids, mask, 4, from_hidden_states=False)
    torch.testing.assert_close(packed.logps, padded.logps)
    assert "_IgnoresPositions does not attend within packed sequences only" in caplog.text
    assert packing._VERIFIED[model] is False
    assert packing._VERIFIED.get(qwen2_model) is None  # the inner model itself was never probed


def test_padding_free_falls_back_on_rows_with_holes_and_refuses_other_layouts(qwen2_model, monkeypatch, caplog):
    monkeypatch.setattr(fallbacks, "_reported", set())
    ids, mask = ragged_batch()
    mask[0, 5] = 0
    with caplog.at_level(logging.INFO, logger="trl_unified.core.packing"):
        packed = compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=True)
    torch.testing.assert_close(packed.logps, compute_token_logprobs(qwen2_model, ids, mask, 4).logps)
    assert "not one contiguous span" in caplog.text
    with pytest.raises(ValueError, match="choose one"):
        compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=True, shared_prefix=True)
    with pytest.raises(ValueError, match="position_ids"):
        compute_token_logprobs(qwen2_model, ids, mask, 4, padding_free=True, position_ids=mask.cumsum(1))


# ---------------------------------------------------------------- trainers
@pytest.mark.parametrize(
    "name, config",
    [("RLOO", {"beta": 0.1}), ("GRPO", {"num_iterations": 2, "beta": 0.1}), ("DPO", {}), ("KTO", {})],
)
def test_trainers_with_padding_free_train_to_the_padded_numbers(name, config, llama_path, tmp_path, monkeypatch):
    """Policy, reference and old-log-prob passes (DPO/KTO: the preference passes, KTO's KL rows) packed: the logged
    numbers and the parameters after 2 SGD steps equal those of the padded rows without prompt sharing."""
    import trl_unified
    import trl_unified.core.logprobs as logprobs
    from tests.generation.test_prefix import _train, _train_preference, assert_same_run

    packed = []
    original = logprobs._score_packed
    monkeypatch.setattr(logprobs, "_score_packed", lambda *a, **k: packed.append(a[2].shape) or original(*a, **k))
    if name in ("DPO", "KTO"):
        run = lambda **options: _train_preference(llama_path, tmp_path, name, **options, **config)  # noqa: E731
        keys = ["loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logits/chosen", "entropy"]
    else:
        classes = getattr(trl_unified, f"{name}Trainer"), getattr(trl_unified, f"{name}Config")
        run = lambda **options: _train(llama_path, tmp_path, *classes, **options, **config)  # noqa: E731
        keys = ["loss", "kl", "entropy", "reward"]
    with_packing = run(padding_free=True)
    # 2 steps x policy + reference (GRPO: one rollout for both steps, its reference and old log-probs; KTO: + the KL
    # rows' policy pass), each packed
    assert len(packed) == {"RLOO": 4, "GRPO": 4, "DPO": 4, "KTO": 6}[name], packed
    count = len(packed)
    padded = run(shared_prefix=False, padding_free=False)
    assert len(packed) == count
    assert_same_run(with_packing, padded, keys)


def test_padding_free_is_auto_by_default_where_prompts_are_not_shared(llama_path, tmp_path, monkeypatch):
    """RLOO with prompt sharing off: the default (`padding_free=None`) packs the policy and reference passes (the
    rollouts' completions end at different lengths) and trains to the padded run's numbers."""
    import trl_unified
    import trl_unified.core.logprobs as logprobs
    from tests.generation.test_prefix import _train, assert_same_run

    packed, decisions = [], []
    original, decide = logprobs._score_packed, logprobs._packs
    monkeypatch.setattr(logprobs, "_score_packed", lambda *a, **k: packed.append(a[2].shape) or original(*a, **k))
    monkeypatch.setattr(logprobs, "_packs", lambda *a, **k: decisions.append(decide(*a, **k)) or decisions[-1])
    classes = trl_unified.RLOOTrainer, trl_unified.RLOOConfig
    auto = _train(llama_path, tmp_path, *classes, shared_prefix=False, beta=0.1)
    assert auto.args.padding_free is None and len(decisions) == 4  # 2 steps x policy + reference passes
    assert 1 <= len(packed) == sum(decisions), (packed, decisions)  # rows with enough padding packed, others not
    padded = _train(llama_path, tmp_path, *classes, shared_prefix=False, padding_free=False, beta=0.1)
    assert len(decisions) == 4 and len(packed) == sum(decisions)
    assert_same_run(auto, padded, ["loss", "kl", "entropy", "reward"])


def test_padding_free_config_checks(tmp_path):
    from trl_unified import DistillationConfig, DPOConfig, GRPOConfig, PPOConfig

    assert GRPOConfig(output_dir=str(tmp_path), bf16=False).padding_free is None  # auto
    assert GRPOConfig(output_dir=str(tmp_path), padding_free="false", bf16=False).padding_free is False
    with pytest.raises(ValueError, match="must be None"):
        GRPOConfig(output_dir=str(tmp_path), padding_free="sometimes", bf16=False)
    assert PPOConfig(output_dir=str(tmp_path), bf16=False).padding_free is False  # padded rows only
    assert DPOConfig(output_dir=str(tmp_path), bf16=False).padding_free is False  # TRL's field and default
    assert DPOConfig(output_dir=str(tmp_path), padding_free="auto", bf16=False).padding_free is None
    assert DistillationConfig(output_dir=str(tmp_path), bf16=False).padding_free is False

    with pytest.raises(ValueError, match="choose one"):
        GRPOConfig(output_dir=str(tmp_path), padding_free=True, shared_prefix=True, bf16=False)
    with pytest.raises(NotImplementedError, match="padding_free=True is accepted for compatibility"):
        DistillationConfig(output_dir=str(tmp_path), padding_free=True, bf16=False)
    with pytest.raises(NotImplementedError, match="value head reads the policy's padded hidden states"):
        PPOConfig(output_dir=str(tmp_path), padding_free=True, bf16=False)
    assert DPOConfig(output_dir=str(tmp_path), padding_free=True, bf16=False).padding_free  # no longer reset
