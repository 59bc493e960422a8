"""The CLI commands, one module each. Only light imports at module level: the heavy ones (torch,
timm) happen inside the command bodies, so ``structinit --help`` stays instant."""
