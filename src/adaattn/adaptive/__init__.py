"""Analysis and control for adaptive precision and rank (block pooling, sampling, controllers)."""
