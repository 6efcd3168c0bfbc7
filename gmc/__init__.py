"""gmc: learned, layer-adaptive group sparsity for Hugging Face causal LMs (GroupMask)."""

__version__ = "0.1.0"
