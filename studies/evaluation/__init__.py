"""The evidence studies behind docs/results.md: baselines, offline ablations, transfer, live and simulated replay."""
