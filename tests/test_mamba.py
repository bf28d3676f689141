"""The chunked Mamba/Mamba2 scans equal the token-by-token recurrence they implement, from any
initial state and for any chunk size (the model tests cover them against transformers)."""

import pytest
import torch

from kestrel.models.layers.mamba import selective_scan, ssd_chunked, ssd_step

B, M, D, N, H, P = 2, 19, 6, 4, 3, 5


def sequential_mamba(x, dt, A, Bm, C, h):
    # h[t] = exp(dt A) h[t-1] + dt x B;  y[t] = h[t] . C[t]   per channel d, state n
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * Bm[:, t, None]
        ys.append((h * C[:, t, None]).sum(-1))
    return torch.stack(ys, 1), h


def sequential_mamba2(x, dt, A, Bm, C, h):
    # the same with one scalar decay per head: h (b, H, P, N)
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * Bm[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_selective_scan_matches_the_recurrence(chunk):
    torch.manual_seed(0)
    x, dt = torch.randn(B, M, D), torch.rand(B, M, D)
    A, Bm, C, h = (
        -torch.rand(D, N) * 4,
        torch.randn(B, M, N),
        torch.randn(B, M, N),
        torch.randn(B, D, N),
    )
    y, state = selective_scan(x, dt, A, Bm, C, h, chunk_size=chunk)
    y_ref, state_ref = sequential_mamba(x, dt, A, Bm, C, h)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(state, state_ref)


@pytest.mark.parametrize("chunk", [1, 4, 7, 32])
def test_ssd_chunked_matches_the_recurrence(chunk):
    torch.manual_seed(0)
    x, dt = torch.randn(B, M, H, P), torch.rand(B, M, H)
    A, Bm, C = -torch.rand(H) * 4, torch.randn(B, M, H, N), torch.randn(B, M, H, N)
    h = torch.randn(B, H, P, N)
    y, state = ssd_chunked(x, dt, A, Bm, C, h, chunk_size=chunk)
    y_ref, state_ref = sequential_mamba2(x, dt, A, Bm, C, h)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(state, state_ref)


def test_ssd_step_matches_the_recurrence():
    torch.manual_seed(0)
    x, dt = torch.randn(B, 1, H, P), torch.rand(B, 1, H)
    A, Bm, C = -torch.rand(H) * 4, torch.randn(B, 1, H, N), torch.randn(B, 1, H, N)
    h = torch.randn(B, H, P, N)
    y, state = ssd_step(x, dt, A, Bm, C, h)
    y_ref, state_ref = sequential_mamba2(x, dt, A, Bm, C, h)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(state, state_ref)
