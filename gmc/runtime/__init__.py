"""What runs a pruned model: ``lower`` (an artifact to a lowered directory, compiled packages,
ONNX or a dense checkpoint), ``generate``, ``evaluate`` (perplexity, lm-eval), ``results`` (the JSON
and tables of ``evaluate``'s numbers), ``report``, and ``refs`` (what ``eval`` and ``generate`` take:
a model, a masks artifact or a lowered directory).
May import: everything below it (base, ``kernels``, ``graph``, ``formats``, ``inputs``, ``masks``).
"""
