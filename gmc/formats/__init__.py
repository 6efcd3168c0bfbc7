"""What gmc writes to disk, and reads back without running code from it.

``outputs`` (which paths gmc owns, ``--overwrite`` rules), ``atomic`` (all-or-nothing writes),
``artifact`` (masks + manifest + model fingerprint), ``lowered`` (packed weights + program),
``compiled`` (AOTInductor packages of the step programs), ``onnx`` (the lowered program as ONNX),
``hf_checkpoint`` (Hugging Face checkpoints: the packed format, and ``--save-dense``'s dense one).
May import: the base modules, ``gmc.kernels``, ``gmc.graph``.
"""
