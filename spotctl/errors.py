"""Typed errors. The CLI maps each to one line on stderr and a non-zero exit code.

Providers raise the ProviderError family and never print or exit themselves.
"""

from __future__ import annotations


class SpotctlError(Exception):
    """Base of every error that spotctl reports to the user as one line."""

    exit_code = 1


class SpecError(SpotctlError):
    """Bad input: config file, flags, names. Nothing was started."""

    exit_code = 2


class NotFoundError(SpotctlError):
    """A named cluster, node or file does not exist."""

    exit_code = 3


class StateError(SpotctlError):
    """The local state (database, cluster directory) is unusable or locked."""

    exit_code = 4


class LockHeld(StateError):
    """Another process holds a cluster lock that was asked for without waiting."""


class ProviderError(SpotctlError):
    """Base of the errors a provider raises. `retryable` says whether backoff may help."""

    exit_code = 5
    retryable = False


class CapacityError(ProviderError):
    """No capacity for this offer right now: fail over to another zone or type quickly."""


class QuotaError(ProviderError):
    """An account limit was hit: stop and tell the user."""

    exit_code = 6


class AuthError(ProviderError):
    """Credentials are missing, wrong or lack permission: stop and tell the user."""

    exit_code = 7


class TransientError(ProviderError):
    """Throttling, 5xx, timeouts: retry with backoff."""

    retryable = True


class BootstrapError(SpotctlError):
    """A host could not be made a spotctl node (SSH, install, agent start)."""

    exit_code = 8
