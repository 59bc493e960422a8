"""`structinit solve` (being written)."""
