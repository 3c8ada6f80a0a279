"""Benchmark implementations behind ``nanoverify bench``; each prints both sides and their ratio in one run."""
