"""The ssh provider: the user's own hosts, joined and released, never launched or terminated."""
