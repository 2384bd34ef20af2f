import pytest
import torch

from trl_unified import compute_token_logprobs, entropy_from_logits, selective_log_softmax


def naive_logprobs(model, input_ids, attention_mask, logits_to_keep, temperature=1.0):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # full (B, T, V)
    logits = logits[:, :-1] / temperature
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logps[:, -logits_to_keep:], logits[:, -logits_to_keep:]


def batch(tokenizer):
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    return ids, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("logits_to_keep", [1, 3, 7])
def test_compute_token_logprobs_matches_full_log_softmax(qwen2_model, tokenizer, temperature, logits_to_keep):
    ids, mask = batch(tokenizer)
    out = compute_token_logprobs(qwen2_model, ids, mask, logits_to_keep, temperature=temperature, compute_entropy=True)
    expected, logits = naive_logprobs(qwen2_model, ids, mask, logits_to_keep, temperature)
    real = mask[:, -logits_to_keep:]  # padding positions are not projected to the vocabulary: they read 0
    assert out.logps.shape == (2, logits_to_keep)
    torch.testing.assert_close(out.logps, expected * real, rtol=1e-5, atol=1e-5)
    probs = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(out.entropy, -(probs * probs.log()).sum(-1) * real, rtol=1e-5, atol=1e-5)


def test_compute_token_logprobs_row_batches_equal_one_pass(qwen2_model, tokenizer):
    ids, mask = batch(tokenizer)
    whole = compute_token_logprobs(qwen2_model, ids, mask, 4).logps
    rows = compute_token_logprobs(qwen2_model, ids, mask, 4, batch_size=1).logps
    torch.testing.assert_close(rows, whole, rtol=1e-5, atol=1e-6)


def test_selective_log_softmax_chunks_equal_naive():
    torch.manual_seed(0)
    logits, index = torch.randn(5, 4, 50), torch.randint(0, 50, (5, 4))
    naive = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    for chunk in (1, 2, 5, None):
        torch.testing.assert_close(selective_log_softmax(logits, index, chunk_size=chunk), naive)
    torch.testing.assert_close(
        entropy_from_logits(logits, chunk_size=2), -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    )


def test_selective_log_softmax_bf16_is_computed_in_float32():
    torch.manual_seed(0)
    logits, index = torch.randn(2, 3, 40).bfloat16(), torch.randint(0, 40, (2, 3))
    out = selective_log_softmax(logits, index)
    assert out.dtype == torch.float32
    naive = torch.log_softmax(logits.float(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, naive)


def test_gradients_flow_through_logprobs(qwen2_model, tokenizer):
    ids, mask = batch(tokenizer)
    compute_token_logprobs(qwen2_model, ids, mask, 3).logps.sum().backward()
    grads = {n: p.grad.clone() for n, p in qwen2_model.named_parameters() if p.grad is not None}
    qwen2_model.zero_grad(set_to_none=True)
    naive_logprobs(qwen2_model, ids, mask, 3)[0].sum().backward()  # the same sum through the full log_softmax
    expected = {n: p.grad for n, p in qwen2_model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys() and grads["lm_head.weight"].abs().sum() > 0
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------- log-probs from hidden states (core/lm_head.py)
def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _both_paths(model, ids, mask, keep, loss_fn, **options):
    """`(hidden-state path, logits path)`: each path's TokenLogprobs and the gradients of `loss_fn(out)`."""
    results, real = [], mask[:, -keep:]
    for from_hidden in (True, False):
        out = compute_token_logprobs(model, ids, mask, keep, from_hidden_states=from_hidden, **options)
        out = out.map(lambda values: values * real.to(values.dtype))  # the logits path also scores padding
        loss_fn(out).backward()
        results.append((out, _grads(model)))
    return results


def _assert_same(hidden_path, logits_path):
    (ours, our_grads), (theirs, their_grads) = hidden_path, logits_path
    torch.testing.assert_close(ours.logps, theirs.logps, rtol=1e-5, atol=1e-5)
    if theirs.entropy is not None:
        torch.testing.assert_close(ours.entropy, theirs.entropy, rtol=1e-5, atol=1e-5)
    assert our_grads and our_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hidden_state_path_equals_logits_path_in_values_and_gradients(
    qwen2_model, tokenizer, temperature, monkeypatch
):
    """Chunks of 3 positions (several per row, across rows), a weighted loss with an entropy bonus under grad."""
    monkeypatch.setattr("trl_unified.core.lm_head._CHUNK_ELEMENTS", 3 * qwen2_model.config.vocab_size)
    ids, mask = batch(tokenizer)
    weights = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.5], [1.0, 0.25, -0.75, 3.0, -2.0]])
    loss = lambda out: (out.logps * weights).sum() - 0.1 * out.entropy.sum()  # noqa: E731
    options = dict(temperature=temperature, compute_entropy=True, entropy_requires_grad=True)
    ours, theirs = _both_paths(qwen2_model, ids, mask, 5, loss, **options)
    _assert_same(ours, theirs)
    assert ours[1]["lm_head.weight"].abs().sum() > 0


def test_hidden_state_path_entropy_without_grad_and_stats(qwen2_model, tokenizer, monkeypatch):
    """Entropies for logging carry no gradient; per-token statistics (the preference trainers') come out per
    position as from the full logits, whatever the chunking."""
    from trl_unified.preference.trainer import preference_token_stats

    monkeypatch.setattr("trl_unified.core.lm_head._CHUNK_ELEMENTS", 4 * qwen2_model.config.vocab_size)
    ids, mask = batch(tokenizer)
    options = dict(compute_entropy=True, logits_stats=preference_token_stats(with_sum_sq_probs=True))
    ours, theirs = _both_paths(qwen2_model, ids, mask, 7, lambda out: out.logps.sum(), **options)
    _assert_same(ours, theirs)
    assert not ours[0].entropy.requires_grad
    logits = qwen2_model(input_ids=ids, attention_mask=mask).logits[:, -8:-1].detach()
    real = mask[:, -7:]
    expected_mean = logits.mean(-1) * real
    torch.testing.assert_close(ours[0].stats["mean_logits"], expected_mean, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[0].stats["is_top1"].bool(), (logits.argmax(-1) == ids[:, -7:]) & real.bool())
    for name in ("mean_logits", "is_top1", "log_sum_sq_probs"):
        torch.testing.assert_close(ours[0].stats[name], theirs[0].stats[name], rtol=1e-5, atol=1e-5)


def test_hidden_state_path_never_builds_full_vocabulary_logits(qwen2_model, tokenizer, monkeypatch):
    """The model projects one position; the head sees at most one chunk of positions at a time, forward and
    backward."""
    monkeypatch.setattr("trl_unified.core.lm_head._CHUNK_ELEMENTS", 2 * qwen2_model.config.vocab_size)
    widths = []
    qwen2_model.lm_head.register_forward_hook(lambda module, args, output: widths.append(output.shape[:-1].numel()))
    ids, mask = batch(tokenizer)
    compute_token_logprobs(qwen2_model, ids, mask, 6).logps.sum().backward()
    assert widths[:2] == [2, 2]  # the model's own forward (one position per row), then the first-use check
    assert max(widths) == 2 and len(widths) == 2 + 6 + 6  # 12 positions in chunks of 2, then recomputed


def test_hidden_state_path_projects_only_real_completion_tokens(qwen2_model, tokenizer, monkeypatch):
    """Completions that end early (right padding): only their real tokens go through the head, forward and
    backward; those values and the gradients of a masked loss are the padded path's, and padding reads 0
    (`score_padding=True` scores it too, as TRL's PPO entropy needs)."""
    monkeypatch.setattr("trl_unified.core.lm_head._CHUNK_ELEMENTS", 2 * qwen2_model.config.vocab_size)
    ids = torch.tensor([[0, 5, 6, 7, 8, 9, 0, 0], [11, 12, 13, 14, 15, 16, 17, 18], [3, 4, 5, 6, 7, 0, 0, 0]])
    mask = (ids != 0).long()
    real = mask[:, -5:]  # 5 completion positions, 3 + 5 + 2 = 10 real
    widths = []
    handle = qwen2_model.lm_head.register_forward_hook(lambda m, a, out: widths.append(out.shape[:-1].numel()))
    out = compute_token_logprobs(qwen2_model, ids, mask, 5, compute_entropy=True)
    (out.logps * real).sum().backward()
    grads = _grads(qwen2_model)
    handle.remove()
    assert widths[2:] == [2] * 5 + [2] * 5  # 10 real positions in chunks of 2, then recomputed; never the 15
    assert torch.all(out.logps[real == 0] == 0) and torch.all(out.entropy[real == 0] == 0)
    full = compute_token_logprobs(qwen2_model, ids, mask, 5, compute_entropy=True, score_padding=True)
    (full.logps * real).sum().backward()
    torch.testing.assert_close(out.logps, full.logps * real, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.entropy, full.entropy * real, rtol=1e-5, atol=1e-6)
    assert torch.all(full.entropy[real == 0] > 0)
    for name, grad in _grads(qwen2_model).items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_hidden_state_path_with_shared_prefix_rows_and_peft(tokenizer):
    """The same numbers through the shared-prompt forward, row batches, and a LoRA model (its reference: the
    adapter disabled)."""
    from peft import LoraConfig, get_peft_model

    from trl_unified.testing import build_causal_lm

    model = get_peft_model(build_causal_lm(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for _, module in model.named_modules():  # LoRA B starts at 0: move it so the adapter changes the logits
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight, std=0.5)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 10, 11], [0, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[1] * 6, [1] * 6, [0, 1, 1, 1, 1, 1]])
    for options in (dict(shared_prefix=True), dict(batch_size=2)):
        ours, theirs = _both_paths(model, ids, mask, 3, lambda out: out.logps.sum(), **options)
        _assert_same(ours, theirs)
    with model.disable_adapter(), torch.no_grad():
        ref = compute_token_logprobs(model, ids, mask, 3).logps
        ref_logits = compute_token_logprobs(model, ids, mask, 3, from_hidden_states=False).logps
    torch.testing.assert_close(ref, ref_logits, rtol=1e-5, atol=1e-5)
    assert (ref - ours[0].logps).abs().max() > 1e-3  # the adapter mattered


def test_hidden_state_path_applies_the_models_logit_transform(tokenizer, monkeypatch):
    """Gemma 2 soft-caps its logits (`final_logit_softcapping`): the chunked head does too (a head that is not a plain
    linear map: each chunk checkpointed, with a weighted entropy bonus)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    monkeypatch.setattr("trl_unified.core.lm_head._CHUNK_ELEMENTS", 3 * len(tokenizer))

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=3.0,
                          pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model = Gemma2ForCausalLM(config)
    ids, mask = batch(tokenizer)
    weights = torch.tensor([[0.5, -1.0, 2.0, 1.0], [1.0, 0.25, -0.75, 3.0]])
    loss = lambda out: (out.logps * weights).sum() - 0.1 * (out.entropy * weights).sum()  # noqa: E731
    ours, theirs = _both_paths(model, ids, mask, 4, loss, temperature=0.8, compute_entropy=True,
                               entropy_requires_grad=True)  # fmt: skip
    _assert_same(ours, theirs)


def test_hidden_state_path_with_lora_on_the_head_and_an_fp32_head(tokenizer, monkeypatch):
    """A LoRA adapter on the head itself (checkpointed module calls, the adapter's gradients), and
    `cast_lm_head_to_fp32` on a bf16 model (the fused function, computing in the head's float32)."""
    from peft import LoraConfig, get_peft_model

    from trl_unified.models.loading import cast_lm_head_to_fp32
    from trl_unified.testing import build_causal_lm

    monkeypatch.setattr("trl_unified.core.lm_head._CHUNK_ELEMENTS", 3 * len(tokenizer))
    ids, mask = batch(tokenizer)
    model = get_peft_model(build_causal_lm(tokenizer), LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    for _, module in model.named_modules():
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight, std=0.5)
    ours, theirs = _both_paths(model, ids, mask, 5, lambda out: out.logps.sum())
    _assert_same(ours, theirs)
    assert any("lm_head.lora_A" in name for name in ours[1])
    model = build_causal_lm(tokenizer).to(torch.bfloat16)
    cast_lm_head_to_fp32(model)
    ours, theirs = _both_paths(model, ids, mask, 5, lambda out: out.logps.sum())
    torch.testing.assert_close(ours[0].logps, theirs[0].logps, rtol=1e-5, atol=1e-5)
    for name, grad in theirs[1].items():  # bf16 parameters: gradients agree to bf16 rounding
        torch.testing.assert_close(ours[1][name].float(), grad.float(), rtol=2e-2, atol=2e-3, msg=name)


def test_hidden_state_path_falls_back_where_the_head_does_not_give_the_logits(qwen2_model, tokenizer, caplog):
    """A model whose logits are not its head on its decoder output (here: a forward that shifts them) is detected
    on its first forward and scored from its own logits, with one log line."""
    import logging

    original = type(qwen2_model).forward

    def shifted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = out.logits + torch.arange(out.logits.size(-1), dtype=out.logits.dtype) * 0.01
        return out

    qwen2_model.forward = shifted.__get__(qwen2_model)
    ids, mask = batch(tokenizer)
    with caplog.at_level(logging.INFO):
        out = compute_token_logprobs(qwen2_model, ids, mask, 3).logps
    expected = compute_token_logprobs(qwen2_model, ids, mask, 3, from_hidden_states=False).logps
    torch.testing.assert_close(out, expected)
    assert "does not give its logits" in caplog.text


def test_hidden_state_path_in_one_chunk_keeps_the_entropy_gradient(qwen2_model, tokenizer):
    """With every position in one chunk (nothing checkpointed) an entropy bonus still carries its gradient."""
    ids, mask = batch(tokenizer)
    loss = lambda out: out.logps.sum() - 0.5 * out.entropy.sum()  # noqa: E731
    options = dict(compute_entropy=True, entropy_requires_grad=True)
    ours, theirs = _both_paths(qwen2_model, ids, mask, 5, loss, **options)
    assert ours[0].entropy.requires_grad
    _assert_same(ours, theirs)


def test_hidden_state_path_in_chunks_with_an_entropy_only_loss(qwen2_model, tokenizer, monkeypatch):
    """Chunks of 2 positions and a loss of the entropies alone (no gradient reaches the log-probs): the chunked
    backward's entropy-only branch equals the logits path."""
    monkeypatch.setattr("trl_unified.core.lm_head._CHUNK_ELEMENTS", 2 * qwen2_model.config.vocab_size)
    ids, mask = batch(tokenizer)
    options = dict(compute_entropy=True, entropy_requires_grad=True)
    ours, theirs = _both_paths(qwen2_model, ids, mask, 5, lambda out: out.entropy.sum(), **options)
    _assert_same(ours, theirs)
    assert ours[1]["lm_head.weight"].abs().sum() > 0


@pytest.mark.parametrize("from_hidden_states", [True, False])
def test_shared_logprobs_with_detached_rows_equal_two_passes(qwen2_model, from_hidden_states):
    """KTO's policy pass: rows 0-2 with grad, rows 3-5 (the same prompts, other completions) without; each prompt
    encoded once. The same values as two plain passes; gradients from the first rows only."""
    from trl_unified.core.logprobs import compute_shared_logprobs

    prompts = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11], [0, 0, 12, 13]])
    completions = torch.tensor([[20, 21, 22], [23, 24, 0], [25, 0, 0], [26, 27, 0], [28, 29, 30], [31, 0, 0]])
    ids = torch.cat([prompts.repeat(2, 1), completions], 1)
    mask = (ids != 0).long()
    options = dict(temperature=0.7, compute_entropy=True, from_hidden_states=from_hidden_states)
    compute_token_logprobs(qwen2_model, ids, mask, 3, **options)  # the head's once-per-model check
    qwen2_model.zero_grad(set_to_none=True)
    out, detached = compute_shared_logprobs(qwen2_model, ids, mask, 3, detached_rows=3, **options)
    (out.logps * mask[:3, -3:]).sum().backward()
    shared_grads = _grads(qwen2_model)
    plain = compute_token_logprobs(qwen2_model, ids[:3], mask[:3], 3, **options)
    (plain.logps * mask[:3, -3:]).sum().backward()
    plain_grads = _grads(qwen2_model)
    with torch.no_grad():
        plain_detached = compute_token_logprobs(qwen2_model, ids[3:], mask[3:], 3, **options).logps
    keep = mask[:, -3:].bool()
    torch.testing.assert_close(out.logps[keep[:3]], plain.logps[keep[:3]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy[keep[:3]], plain.entropy[keep[:3]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(detached[keep[3:]], plain_detached[keep[3:]], rtol=1e-5, atol=1e-5)
    assert not detached.requires_grad and shared_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    distinct = torch.cat([prompts, prompts + 40], 1).view(6, 4)  # six different prompts: nothing to share
    distinct_ids = torch.cat([distinct, completions], 1)
    assert compute_shared_logprobs(qwen2_model, distinct_ids, (distinct_ids != 0).long(), 3, 3, **options) is None


@pytest.mark.parametrize("from_hidden_states", [True, False])
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_prompt_scores_equal_full_log_softmax_in_values_and_gradients(qwen2_model, from_hidden_states, shared_prefix):
    """`score_prompt`: the prompt tokens after the first (ORPO's NLL), from the shared prompt pass (rows 0 and 1
    share a prompt; row 2's is left-padded) or from the rows' own pass, equal the full log-softmax of every position,
    and so does the gradient of a loss over prompt and completion tokens."""
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 10, 11], [0, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[1] * 6, [1] * 6, [0, 1, 1, 1, 1, 1]])
    keep, prompt = 3, 3  # 3 completion tokens after a 3-token prompt
    out = compute_token_logprobs(qwen2_model, ids, mask, keep, shared_prefix=shared_prefix, score_prompt=True,
                                 from_hidden_states=from_hidden_states)  # fmt: skip
    real = (mask[:, 1:prompt] * mask[:, : prompt - 1]).float()  # a token predicted from padding is not scored
    (out.prompt_logps.sum() + out.logps.sum()).backward()
    grads = _grads(qwen2_model)
    full, _ = naive_logprobs(qwen2_model, ids, mask, ids.size(1) - 1)  # (B, T - 1): every position
    torch.testing.assert_close(out.prompt_logps, full[:, : prompt - 1] * real, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logps, full[:, -keep:], rtol=1e-5, atol=1e-5)
    ((full[:, : prompt - 1] * real).sum() + full[:, -keep:].sum()).backward()
    for name, grad in _grads(qwen2_model).items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
