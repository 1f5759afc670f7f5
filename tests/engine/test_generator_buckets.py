"""The generator's default batch buckets: the rows a step of ``n`` live requests runs."""

from __future__ import annotations

import pytest

from replayssm.engine.generator import default_buckets


@pytest.mark.parametrize("num_slots", [1, 2, 3, 16, 17, 40, 64, 100, 256, 1000])
def test_default_buckets_waste_under_a_quarter_above_16_rows(num_slots):
    """Increasing, ending at ``num_slots``; the smallest bucket that holds ``n`` live
    requests has at most ``2n - 1`` rows up to 16 (powers of two) and fewer than
    ``1.25 n`` above 16 (quarter octaves), at every ``n`` up to ``num_slots``."""
    buckets = default_buckets(num_slots)
    assert list(buckets) == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == num_slots
    for n in range(1, num_slots + 1):
        rows = next(b for b in buckets if b >= n)
        assert rows <= (2 * n - 1 if n <= 16 else 1.25 * n - 1e-9) or rows == n, (n, rows)


def test_default_buckets_at_256_slots():
    assert default_buckets(256) == (1, 2, 4, 8, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224,
                                    256)
