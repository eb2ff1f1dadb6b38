"""Closed-loop and trace-replay benchmarking of SGLang-protocol servers."""
