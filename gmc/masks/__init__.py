"""Where masks come from: the prune stage (``prune``; ``prune_distributed`` for a torchrun worker) and its mask sources -- learning
(``learn``: hypernetwork, budget, prior, the cached ``teacher``, the training ``harness``,
``distributed``), one-shot ``heuristics`` (magnitude, Wanda; uniform, global, OWL allocation),
``sparsegpt`` -- and what updates the kept weights afterwards (``recover``: distillation;
``reconstruct``: OBS + CG).
May import: everything below it (base, ``kernels``, ``graph``, ``formats``, ``inputs``).
"""
