"""The graph stage: a causal LM as a ``torch.export`` graph and the passes over it.

``trace`` (the logits graph), ``targets`` (which linears are pruned), ``selector`` (the node a
selector pass inserts), ``head`` (a logits graph split at its output head), ``decode`` (the
prefill/decode step programs over a static KV cache), ``pipeline`` (the ordered pass lists every
command runs) and ``passes/`` (one pass per file).
May import: ``gmc.errors``, ``gmc.config``, ``gmc.groups``, ``gmc.kernels``.
"""
