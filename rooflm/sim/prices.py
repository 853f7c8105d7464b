"""Rental prices per GPU-hour for `rooflm simulate --plan`, and where they are from.

On-demand prices of one GPU vary 2-3x between clouds; these are the middle of the
"specialty cloud" tier of one published survey, to rank layouts, not to quote a bill.
Override them with --price h100=2.49,h200=3.80.

Source: Mercatus, "Cloud GPU pricing" (May 2026), https://www.mercatus-ai.com/blog/cloud-gpu-pricing
("specialty" tier on-demand: A100 80GB $1.10-1.50, H100 SXM5 $2.50-3.50, H200 SXM5 $3.50-4.50).
"""

from __future__ import annotations

PRICE_SOURCE = "Mercatus cloud GPU pricing survey, May 2026, specialty-cloud on-demand midpoints"
PRICES_PER_GPU_HOUR: dict[str, float] = {"a100": 1.30, "h100": 3.00, "h200": 4.00}


def parse_prices(text: str | None) -> dict[str, float]:
    """'h100=2.49,h200=3.8' -> the table with those entries replaced or added."""
    prices = dict(PRICES_PER_GPU_HOUR)
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        key, sep, value = part.partition("=")
        try:
            price = float(value.lstrip("$"))
        except ValueError:
            price = -1.0
        if not sep or price <= 0:
            raise ValueError(f"--price takes GPU=DOLLARS_PER_HOUR terms, e.g. h100=2.49; got {part!r}")
        prices[key.lower()] = price
    return prices
