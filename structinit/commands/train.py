"""`structinit train` (registered on the app when implemented)."""
