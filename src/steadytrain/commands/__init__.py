"""One module per sub-command; see ``steadytrain.cli``."""
