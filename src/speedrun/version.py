"""speedrun's version, apart from the package's face: the modules that record it (checkpoints,
results.json) sit below what the face re-exports."""
__version__ = "0.1.0"
