"""What the command-line tools share: their common options and checks (docs/architecture.md:
the top layer, which nothing in the package imports)."""
