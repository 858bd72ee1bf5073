"""Rank processes, the local launcher and platform tuning."""
