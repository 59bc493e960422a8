"""`structinit apply` (registered on the app when implemented)."""
