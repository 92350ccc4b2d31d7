"""Measurement tools: benchmarks and checks that import the core; the core never imports them."""
