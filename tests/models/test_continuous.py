"""The continuous-signal math of the ∞-former (models/infinity_former.py, "continuous signals")."""

import math

import torch

from xlserve.models.infinity_former import (
    RBFMemory,
    counter_uniforms,
    evaluate_basis,
    gaussian_bin_mass,
    gaussian_expectation,
    kl_to_gaussian,
    rbf_basis,
    ridge_operator,
    sample_from_histogram,
)

WIDTHS = [0.01, 0.05]


def smooth(t: torch.Tensor) -> torch.Tensor:
    """A smooth 3-dimensional test signal on [0, 1]: (P,) -> (P, 3)."""
    return torch.stack([torch.sin(2 * math.pi * t), torch.cos(5 * t) + t**2, t * torch.sin(9 * t)], dim=-1)


def memory(**overrides) -> RBFMemory:
    args = dict(n_basis=128, widths=WIDTHS, segment_len=128, n_samples=128, tau=0.5, ridge_penalty=0.5, n_bins=64)
    args.update(overrides)
    return RBFMemory(**args).double()


def test_closed_form_expectation_matches_numerical_integration():
    centres, widths = rbf_basis(16, WIDTHS)
    t = torch.linspace(-3.0, 4.0, 200_001, dtype=torch.float64)
    psi = evaluate_basis(t, centres, widths)  # (P, N)
    for mu, sigma in [(0.5, 0.2), (0.1, 0.03), (0.93, 0.005), (0.3, 0.6)]:
        density = torch.exp(-0.5 * ((t - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
        numeric = torch.trapezoid(density[:, None] * psi, t, dim=0)
        mu_t, sigma_sq_t = torch.tensor(mu, dtype=torch.float64), torch.tensor(sigma**2, dtype=torch.float64)
        closed = gaussian_expectation(mu_t, sigma_sq_t, centres, widths)
        assert torch.allclose(closed, numeric, rtol=1e-6, atol=1e-8), (mu, sigma)


def test_grid_expectation_equals_generic_formula_and_has_correct_gradients():
    geometry = memory()
    mu = torch.rand(3, 5, dtype=torch.float64, requires_grad=True)
    sigma_sq = (torch.rand(3, 5, dtype=torch.float64) * 0.05 + 1e-4).requires_grad_()
    fast = geometry.expectation(mu, sigma_sq)
    generic = gaussian_expectation(mu, sigma_sq, geometry.centres, geometry.widths)
    assert torch.allclose(fast, generic, rtol=1e-12, atol=1e-12)
    small = memory(n_basis=16)
    assert torch.autograd.gradcheck(small.expectation, (mu, sigma_sq))


def test_ridge_regression_reconstructs_a_smooth_signal():
    centres, widths = rbf_basis(128, WIDTHS)
    positions = (torch.arange(256, dtype=torch.float64) + 0.5) / 256
    coefficients = ridge_operator(positions, centres, widths, penalty=1e-3) @ smooth(positions)  # (N, 3)
    dense = torch.linspace(0, 1, 2001, dtype=torch.float64)
    error = (evaluate_basis(dense, centres, widths) @ coefficients - smooth(dense)).abs().max()
    assert error < 5e-3  # everywhere, also between the fitted points
    # the default penalty (0.5) shrinks a little, mostly at the ends of [0, 1]
    coefficients = ridge_operator(positions, centres, widths, penalty=0.5) @ smooth(positions)
    error = (evaluate_basis(dense, centres, widths) @ coefficients - smooth(dense)).abs().max(dim=1).values
    assert error[100:-100].max() < 0.02 and error.max() < 0.1


def test_contraction_keeps_the_old_signal_shape_on_zero_to_tau():
    geometry = memory(ridge_penalty=1e-3, tau=0.5)
    positions = (torch.arange(256, dtype=torch.float64) + 0.5) / 256
    old = (ridge_operator(positions, geometry.centres, geometry.widths, 1e-3) @ smooth(positions))[None]  # (1, N, 3)
    new_positions = (torch.arange(128, dtype=torch.float64) + 0.5) / 128
    new = smooth(new_positions)[None].flip(-1)  # something else on (τ, 1]
    updated = geometry.update(old, new, geometry.even_points[None])

    t = torch.linspace(0.05, 0.95, 181, dtype=torch.float64)[None]
    before = geometry.evaluate(old, t)
    after = geometry.evaluate(updated, 0.5 * t)  # the old signal now lives on [0, τ]
    assert (after - before).abs().max() < 0.03
    appended = geometry.evaluate(updated, 0.5 + 0.5 * new_positions[None])
    assert (appended - new).abs()[:, 13:].max() < 0.03  # away from the jump at τ


def test_small_sigma_reads_the_signal_at_mu():
    geometry = memory()
    positions = (torch.arange(256, dtype=torch.float64) + 0.5) / 256
    coefficients = ridge_operator(positions, geometry.centres, geometry.widths, 0.5) @ smooth(positions)
    mu = torch.tensor([0.03, 0.21, 0.5, 0.77, 0.98], dtype=torch.float64)
    read = geometry.expectation(mu, torch.full_like(mu, 1e-12)) @ coefficients
    at_mu = evaluate_basis(mu, geometry.centres, geometry.widths) @ coefficients
    assert torch.allclose(read, at_mu, atol=1e-8)
    # a wide density reads a blur instead
    blurred = geometry.expectation(mu, torch.full_like(mu, 0.05)) @ coefficients
    assert (blurred - at_mu).abs().max() > 0.1


def test_bin_mass_is_the_probability_of_each_bin():
    edges = torch.linspace(0, 1, 11, dtype=torch.float64)
    mu = torch.tensor([0.5, 0.05, 1.2], dtype=torch.float64)
    sigma_sq = torch.tensor([0.01, 0.0004, 0.09], dtype=torch.float64)
    mass = gaussian_bin_mass(mu, sigma_sq, edges)
    normal = torch.distributions.Normal(mu[:, None], sigma_sq.sqrt()[:, None])
    inside = normal.cdf(torch.tensor(1.0)) - normal.cdf(torch.tensor(0.0))
    assert torch.allclose(mass.sum(-1), inside.squeeze(-1), atol=1e-12)
    assert mass[0].argmax() in (4, 5) and mass[1].argmax() == 0 and mass[2].argmax() == 9


def test_kl_matches_torch_distributions():
    mu = torch.tensor([0.2, 0.7], dtype=torch.float64)
    sigma_sq = torch.tensor([0.3, 0.001], dtype=torch.float64)
    p = torch.distributions.Normal(mu, sigma_sq.sqrt())
    q = torch.distributions.Normal(torch.tensor(0.4, dtype=torch.float64), torch.tensor(0.05, dtype=torch.float64))
    assert torch.allclose(kl_to_gaussian(mu, sigma_sq, 0.05, 0.4), torch.distributions.kl_divergence(p, q))
    width_only = kl_to_gaussian(mu, sigma_sq, 0.05, None)  # as if μ₀ were μ
    same_mean = torch.distributions.Normal(mu, torch.tensor(0.05, dtype=torch.float64))
    assert torch.allclose(width_only, torch.distributions.kl_divergence(p, same_mean))


def test_counter_uniforms_are_deterministic_per_row_and_look_uniform():
    seeds = torch.tensor([0, 1, 2**40 + 3, 7], dtype=torch.int64)
    u = counter_uniforms(seeds, stream=3, n=4096)
    assert torch.equal(u, counter_uniforms(seeds, stream=3, n=4096))
    assert torch.equal(u[2:3], counter_uniforms(seeds[2:3], stream=3, n=4096))  # whatever the batch
    assert not torch.equal(u, counter_uniforms(seeds, stream=4, n=4096))
    assert ((u > 0) & (u < 1)).all()
    assert (u.mean(-1) - 0.5).abs().max() < 0.02
    counts = torch.histc(u[0].float(), bins=8, min=0, max=1)
    assert (counts - 512).abs().max() < 100
    assert len(set(u[:, 0].tolist())) == 4


def test_histogram_sampling_follows_the_mass():
    edges = torch.linspace(0, 1, 5, dtype=torch.float64)
    histogram = torch.tensor([[0.0, 3.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    uniforms = counter_uniforms(torch.tensor([5, 6]), stream=0, n=20_000).sort(-1).values
    points = sample_from_histogram(histogram, uniforms, edges)
    assert (points[0].diff() >= 0).all()  # sorted uniforms give sorted points
    in_bin = torch.histc(points[0].float(), bins=4, min=0, max=1) / 20_000
    assert torch.allclose(in_bin, torch.tensor([0.0, 0.75, 0.25, 0.0]), atol=0.01)
    empty = torch.histc(points[1].float(), bins=4, min=0, max=1) / 20_000  # no mass at all: uniform
    assert torch.allclose(empty, torch.full((4,), 0.25), atol=0.01)
