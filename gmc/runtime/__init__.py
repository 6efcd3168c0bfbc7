"""What runs a pruned model: ``lower`` (an artifact to a lowered directory, compiled packages,
ONNX or a dense checkpoint), ``generate``, ``evaluate`` (perplexity, lm-eval) and ``report``.
May import: everything below it (base, ``kernels``, ``graph``, ``formats``, ``inputs``, ``masks``).
"""
