"""Why untrained Transformers are not near the isotropic null (docs/metrics.md): with
Hugging Face's default initialisation the MLP's GELU has a positive mean on zero-mean inputs, so
every block adds one shared vector, W_out^T E[GELU(z)] + b_out, to every token. Shown on a
GPT-2 of GPT-2 small's width (two blocks, untrained), against the Gaussian formula for E[GELU]
and against the same MLP with an odd activation (tanh: E = 0), where the shared part vanishes. The
untrained attention adds a shared part of its own (near-uniform weights average the context)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats


def _run(activation: str):
    """The first block's MLP on the model's own (isotropic) embeddings, normalised by its ln_2 as
    in the block, and the model's hidden states."""
    import torch
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=1000, n_embd=768, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    config.activation_function = activation
    model = GPT2Model(config).eval()
    ids = torch.randint(0, 1000, (6, 48), generator=torch.Generator().manual_seed(1))
    block = model.h[0]
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        z = block.ln_2(hidden[0])
        pre = block.mlp.c_fc(z).reshape(-1, 3072).double().numpy()
        out = block.mlp(z).reshape(-1, 768).double().numpy()
    w_out = block.mlp.c_proj.weight.detach().double().numpy()  # Conv1D: (3072, 768), y = g @ W + b
    b_out = block.mlp.c_proj.bias.detach().double().numpy()
    layers = [h.reshape(-1, 768).double().numpy() for h in hidden[:-1]]  # the last: ln_f's output
    return pre, out, w_out, b_out, layers


def _shared_share(x: np.ndarray) -> float:
    """The share of the vectors' mean energy that is their common (mean) vector."""
    mean = x.mean(0)
    return float(mean @ mean / (x * x).sum(1).mean())


def _avg_cos(x: np.ndarray) -> float:
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    n = len(u)
    return float(((u.sum(0) ** 2).sum() - n) / (n * (n - 1)))


def test_untrained_mlp_adds_one_shared_vector_to_every_token():
    pre, out, w_out, b_out, layers = _run("gelu_new")
    # each hidden unit's pre-activation over tokens, taken as N(mu, sd^2): centred on isotropic
    # embeddings, and GELU's mean on it is mu Phi(mu/s) + sd^2 phi(mu/s)/s with s = sqrt(1 + sd^2),
    # > 0 at mu = 0 (GELU's even part, z (Phi(z) - 1/2), is never negative)
    mu, sd = pre.mean(0), pre.std(0)
    assert np.abs(mu).mean() < 0.2 * sd.mean()
    s = np.sqrt(1 + sd**2)
    e_gelu = mu * stats.norm.cdf(mu / s) + sd**2 * stats.norm.pdf(mu / s) / s
    assert e_gelu.mean() > 0.05
    shared = e_gelu @ w_out + b_out  # the vector the block adds to every token
    mean = out.mean(0)
    assert shared @ mean / (np.linalg.norm(shared) * np.linalg.norm(mean)) > 0.99
    assert np.linalg.norm(shared) == pytest.approx(np.linalg.norm(mean), rel=0.05)
    assert _shared_share(out) > 0.1  # a tenth and more of the MLP output: one vector for every token
    assert _shared_share(layers[0]) < 0.02  # while its input shares next to nothing
    # avg_cos climbs from the (isotropic) embeddings, and drift with it: Spearman rho = 1
    cos = [_avg_cos(x) for x in layers]
    drift = [float(np.linalg.norm(x.mean(0))) for x in layers]
    assert cos[0] < 0.02 < 0.1 < cos[-1]
    assert stats.spearmanr(drift, cos).statistic == pytest.approx(1.0)


def test_an_odd_activation_adds_no_shared_vector():
    _pre, out, _w, b_out, layers = _run("tanh")
    assert np.all(b_out == 0)  # untrained: biases zero, so the mean is the activation's alone
    assert _shared_share(out) < 0.02  # tanh is odd: E[tanh(z)] ~ 0 on centred inputs
    gelu = _run("gelu_new")
    assert _shared_share(out) < _shared_share(gelu[1]) / 5
    # the rest of the first block's shared part is attention's: near-uniform weights average the
    # values over the context, nearly the same vector for every token, whatever the activation
    assert 0.1 < _avg_cos(layers[1]) < _avg_cos(gelu[4][1])
