"""Initializations as typed specs, and their injection into models and checkpoints of every known layout."""
