"""gmc's own lm-eval tasks (YAML + loaders); ``gmc eval`` always puts this directory on the
lm-eval include path. See ``jargon_next.py``."""
