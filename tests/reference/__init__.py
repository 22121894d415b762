"""Slow, obviously-correct loop implementations used as test oracles (float64 only)."""
