"""Graph passes over the traced GraphModule, one per file; see README.md for the invariants."""
