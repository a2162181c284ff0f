"""Small helpers every layer may use: safe writes (outputs.py), forked children with limits
(isolate.py), progress lines, plots, lazy exports, a user's factory, what a file is."""
