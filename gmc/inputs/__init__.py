"""What gmc reads: models (hub ids, local directories, GGUF files, the bundled SmolLM2) and text
(calibration and held-out sets: bundled, WikiText-2, Alpaca, local files, self-generated).
May import: the base modules, ``gmc.kernels``, ``gmc.graph``, ``gmc.formats``.
"""
