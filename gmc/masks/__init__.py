"""Where masks come from and what updates the kept weights afterwards.

The prune stage: ``prune`` (``prune_distributed`` for a torchrun worker) runs one mask source of
``sources`` (the table of ``--method``: one module per method). The sources' mechanics:
  * learning: its settings (``learn``) and the run (``training``) with the ``hypernet``, the
    ``budget``, the ``prior`` (``--init``), the cached ``teacher``, the ``student``'s step and
    optimizer, the ``distill`` loss, the step loop of ``harness`` with its ``checkpoint``s, data
    parallelism (``distributed``);
  * one-shot: ``heuristics`` (allocations of element scores: uniform, global, OWL, N:M) and
    ``sparsegpt`` (block by block over the model) on the OBS math of one linear (``obs``).
After the masks: ``recover`` (distillation of the kept weights) and ``reconstruct`` (OBS + CG).
May import: everything below it (base, ``kernels``, ``graph``, ``formats``, ``inputs``).
"""
