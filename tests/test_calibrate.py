"""The one root finder every calibration uses: per head, the log-scale at which a head's attention
mass on its target reaches the asked value."""

import torch

from structinit.solver.calibrate import log_scale_root


def sigmoid_heads(centres):
    """Mass ``sigmoid(u - c_h)`` per head and its slope: a head reaches 0.5 at ``u = c_h``."""
    c = torch.tensor(centres, dtype=torch.float64)

    def mass_and_slope(u):
        m = torch.sigmoid(u - c)
        return m, m * (1 - m)

    return mass_and_slope


def test_each_head_finds_its_own_root():
    u = log_scale_root(sigmoid_heads([0.0, 3.0, -2.5]), 0.5, torch.full((3,), -10.0, dtype=torch.float64),
                       torch.full((3,), 10.0, dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
                       max_iter=60, tol=1e-9)
    assert torch.allclose(u, torch.tensor([0.0, 3.0, -2.5], dtype=torch.float64), atol=1e-6)


def test_a_head_within_tolerance_stops_where_it_is_while_the_others_go_on():
    lo, hi = torch.full((2,), -10.0, dtype=torch.float64), torch.full((2,), 10.0, dtype=torch.float64)
    start = torch.tensor([0.01, -2.0], dtype=torch.float64)  # head 0 starts within 0.01 of its mass
    u = log_scale_root(sigmoid_heads([0.0, 3.0]), 0.5, lo, hi, start, max_iter=60, tol=0.01, bracket_tol=1e-9)
    assert float(u[0]) == 0.01  # done heads stop moving, even while another narrows its bracket
    assert abs(float(torch.sigmoid(u[1] - 3.0)) - 0.5) <= 0.01


def test_a_head_that_cannot_reach_the_mass_ends_at_the_top_of_its_bracket():
    lo, hi = torch.full((2,), -10.0, dtype=torch.float64), torch.full((2,), 1.0, dtype=torch.float64)
    u = log_scale_root(sigmoid_heads([0.0, 5.0]), 0.5, lo, hi, torch.zeros(2, dtype=torch.float64), max_iter=60,
                       tol=1e-6, stop_if_unreachable=True)
    assert float(u[1]) == 1.0 and abs(float(u[0])) < 1e-5
