"""Runnable examples and sample models for attnres-compile."""
