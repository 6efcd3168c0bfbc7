"""What runs and inspects a pruned model: ``generate`` and ``chat`` (streamed text, multi-turn chat),
``evaluate`` (perplexity, lm-eval), ``results`` (the JSON and tables of ``evaluate``'s numbers),
``report``, ``info`` (what a path gmc wrote holds), ``refs`` (what ``eval``, ``generate`` and
``bench`` take: a model, a masks artifact or a lowered directory), ``steps`` (a ref as the
prefill/decode steps ``generate`` and ``bench`` run), ``bench`` (pp/tg speed) and ``host`` (the
machine, ``gmc env``). May import: everything below it (base, ``kernels``, ``graph``, ``formats``,
``inputs``, ``masks``, ``lower``).
"""
