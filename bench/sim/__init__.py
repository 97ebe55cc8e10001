"""Discrete-event simulator of a Mooncake cluster, driven by the policies in ``cluster/``."""
