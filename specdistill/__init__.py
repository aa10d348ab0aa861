"""specdistill: the one installed name of the project's packages.

The folders keep the project's layout (models/, decode/, distill/, train/ at the top of the checkout); the package
build installs them as specdistill.models, specdistill.decode, specdistill.distill and specdistill.train
(pyproject.toml's package-dir), so nothing collides with another project's `models` or `train` and no entrypoint
edits sys.path. Import them so: `from specdistill.decode.engine import SpeculativeEngine`.
"""

__version__ = "0.1.0"
