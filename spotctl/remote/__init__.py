"""SSH: connections with pinned host keys, node bootstrap, tunnels to the head."""
