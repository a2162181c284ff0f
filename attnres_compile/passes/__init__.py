"""Passes: a framework-neutral graph view, chain analysis on it, and per-format rewriters."""
