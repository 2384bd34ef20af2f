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
    assert out.logps.shape == (2, logits_to_keep)
    torch.testing.assert_close(out.logps, expected, rtol=1e-5, atol=1e-5)
    probs = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(out.entropy, -(probs * probs.log()).sum(-1), rtol=1e-5, atol=1e-5)


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
