"""Experiment infrastructure: jobs of N machines as Python code, run in tmux, over SSH."""
