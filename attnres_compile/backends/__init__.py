"""Compiler backends for the depth-attention op."""
