import math

import pytest
import torch

from mmgoal.models.layers.gpo import GPO, MaxPool, MeanPool, sinusoidal_positions


def gru_direction_by_hand(gru, inputs, suffix):
    """PyTorch's GRU equations, one step at a time, for one direction of one sequence."""
    w_ih, w_hh = getattr(gru, f"weight_ih_l0{suffix}"), getattr(gru, f"weight_hh_l0{suffix}")
    b_ih, b_hh = getattr(gru, f"bias_ih_l0{suffix}"), getattr(gru, f"bias_hh_l0{suffix}")
    hidden = torch.zeros(gru.hidden_size, dtype=torch.float64)
    states = []
    for x in inputs:
        gi = w_ih.double() @ x + b_ih.double()
        gh = w_hh.double() @ hidden + b_hh.double()
        r = torch.sigmoid(gi[:gru.hidden_size] + gh[:gru.hidden_size])
        z = torch.sigmoid(gi[gru.hidden_size:2 * gru.hidden_size]
                          + gh[gru.hidden_size:2 * gru.hidden_size])
        n = torch.tanh(gi[2 * gru.hidden_size:] + r * gh[2 * gru.hidden_size:])
        hidden = (1 - z) * n + z * hidden
        states.append(hidden)
    return torch.stack(states)


def gpo_weights_by_hand(gpo, length):
    """Position encodings -> both GRU directions over the real positions only -> weights."""
    encoding = torch.zeros(length, gpo.d_pe, dtype=torch.float64)
    for pos in range(length):
        for i in range(0, gpo.d_pe, 2):
            angle = pos / 10000 ** (i / gpo.d_pe)
            encoding[pos, i], encoding[pos, i + 1] = math.sin(angle), math.cos(angle)
    forward = gru_direction_by_hand(gpo.gru, encoding, "")
    backward = gru_direction_by_hand(gpo.gru, encoding.flip(0), "_reverse").flip(0)
    scores = gpo.linear.weight.double() @ ((forward + backward) / 2).T
    return torch.softmax(scores[0] / gpo.temperature, dim=0)


def test_sinusoidal_positions_match_the_formula():
    encoding = sinusoidal_positions(5, 8)
    assert encoding[3, 2] == pytest.approx(math.sin(3 / 10000 ** (2 / 8)), abs=1e-6)
    assert encoding[3, 3] == pytest.approx(math.cos(3 / 10000 ** (2 / 8)), abs=1e-6)
    assert torch.equal(encoding[0], torch.tensor([0.0, 1.0] * 4))


@torch.no_grad()
def test_gpo_weights_equal_a_hand_computed_gru_and_softmax():
    torch.manual_seed(0)
    gpo = GPO(d_pe=8, d_hidden=6)
    lengths = torch.tensor([5, 2, 7])
    weights = gpo.pool_weights(lengths, 7)
    for row, length in enumerate(lengths.tolist()):
        expected = gpo_weights_by_hand(gpo, length).float()
        torch.testing.assert_close(weights[row, :length], expected, atol=1e-5, rtol=1e-5)
        assert torch.all(weights[row, length:] == 0)


@torch.no_grad()
def test_gpo_weights_depend_only_on_the_set_length_and_sum_to_one():
    torch.manual_seed(1)
    gpo = GPO()
    features = torch.randn(4, 9, 5)
    lengths = torch.tensor([9, 4, 4, 1])
    _, weights = gpo(features, lengths)
    torch.testing.assert_close(weights.sum(1), torch.ones(4))
    torch.testing.assert_close(weights[1], weights[2])
    assert weights[3, 0] == pytest.approx(1.0)
    _, other = gpo(torch.randn(4, 9, 5) * 10, lengths)
    torch.testing.assert_close(weights, other)


@torch.no_grad()
def test_gpo_sorts_every_channel_independently_and_ignores_padding():
    torch.manual_seed(2)
    gpo = GPO()
    features = torch.randn(2, 6, 3)
    lengths = torch.tensor([6, 4])
    pooled, weights = gpo(features, lengths)
    for row, length in enumerate(lengths.tolist()):
        for channel in range(3):
            ordered = features[row, :length, channel].sort(descending=True).values
            expected = (ordered * weights[row, :length]).sum()
            assert pooled[row, channel] == pytest.approx(float(expected), abs=1e-6)
    changed = features.clone()
    changed[1, 4:] = 100.0  # padding
    torch.testing.assert_close(gpo(changed, lengths)[0], pooled)


def test_mean_and_max_pool_use_real_tokens_only():
    features = torch.tensor([[[1.0, -2.0], [3.0, 0.0], [50.0, 50.0]]])
    lengths = torch.tensor([2])
    mean, weights = MeanPool()(features, lengths)
    torch.testing.assert_close(mean, torch.tensor([[2.0, -1.0]]))
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5, 0.0]]))
    torch.testing.assert_close(MaxPool()(features, lengths)[0], torch.tensor([[3.0, 0.0]]))


def test_gpo_gradients_reach_the_features_and_its_gru():
    torch.manual_seed(3)
    gpo = GPO(d_pe=8, d_hidden=4)
    features = torch.randn(3, 5, 4, requires_grad=True)
    pooled, _ = gpo(features, torch.tensor([5, 3, 2]))
    pooled.pow(2).sum().backward()
    assert features.grad[1, 3:].abs().sum() == 0  # padding gets no gradient
    assert features.grad[1, :3].abs().sum() > 0
    assert gpo.gru.weight_hh_l0.grad.abs().sum() > 0
