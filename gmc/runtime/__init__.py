"""What runs a pruned model: ``lower`` (an artifact to a lowered directory, compiled packages,
ONNX or a dense checkpoint), ``generate``, ``evaluate`` (perplexity, lm-eval), ``results`` (the JSON
and tables of ``evaluate``'s numbers), ``report``, ``refs`` (what ``eval`` and ``generate`` take:
a model, a masks artifact or a lowered directory), ``steps`` (a ref as the prefill/decode steps
``generate`` and ``bench`` run), ``bench`` (pp/tg speed) and ``host`` (the machine, ``gmc env``).
May import: everything below it (base, ``kernels``, ``graph``, ``formats``, ``inputs``, ``masks``).
"""
