"""The local provider: nodes are process trees on this machine, each with its own emulated metadata endpoint."""
