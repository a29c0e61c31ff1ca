"""What a run leaves on disk and how it is read back: the config schema, checkpoints,
run directories, the preprocessing resolver and models ready to evaluate.

Below both the engine (which writes runs through it) and the evaluation, the Python
API and the tools (which read runs through it): docs/architecture.md.
"""
