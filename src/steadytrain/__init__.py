"""steadytrain."""
