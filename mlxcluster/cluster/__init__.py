"""Cluster formation (``mlxcluster join``): mDNS discovery, typed membership, the formation planner, the node daemon and its clients."""
