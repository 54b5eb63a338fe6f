"""Providers, imported lazily by name so a missing cloud SDK never breaks another cloud."""

from __future__ import annotations

import importlib
from typing import Any

from spotctl.errors import SpecError
from spotctl.providers.base import HeadInfo, Instance, Offer, Provider, ProviderContext

__all__ = ["HeadInfo", "Instance", "Offer", "Provider", "ProviderContext", "get_provider"]

KNOWN = ("local", "aws", "gcp", "ssh")


def get_provider(name: str, ctx: ProviderContext) -> Any:
    """Return the provider `name` for this cluster. Each module exposes `create(ctx)`."""
    if name not in KNOWN:
        raise SpecError(f"provider: unknown provider {name!r} (choose from {', '.join(KNOWN)})")
    try:
        mod = importlib.import_module(f"spotctl.providers.{name}.provider")
    except ImportError as e:
        extra = {"aws": "aws", "gcp": "gcp", "local": "train"}.get(name, "")
        hint = f"; install spotctl[{extra}]" if extra else ""
        raise SpecError(f"provider {name!r} is not available: {e}{hint}") from None
    return mod.create(ctx)
