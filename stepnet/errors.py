"""The exceptions stepnet raises.

Every error is a ``ValueError`` subclass, so code that already catches
``ValueError`` keeps working; catch ``stepnet.errors.Error`` for all of them.
"""


class Error(ValueError):
    """Base class of every stepnet error."""


class LoDError(Error):
    """A LoD (level-of-detail offsets) is malformed or does not fit its data."""


class StepNetError(Error):
    """A step-net definition is wrong (raised while it is being defined)."""


class ShapeError(StepNetError):
    """Shapes or dtypes do not fit together (an op's operands, a rebinding)."""


class YAMLError(Error):
    """A YAML network file is malformed; the message names file, line and key."""


class BackendError(Error):
    """A backend is unknown or not available on this machine."""


class UnsupportedError(Error):
    """A feature, op or attribute that stepnet does not support."""


class SizeError(Error, MemoryError):
    """An array would take more memory than the machine has, or than
    ``sn.config.max_memory`` allows; raised before it is allocated, the
    message names the array and the amount."""


def optional_import(module: str, what: str, install: str):
    """Import one of stepnet's optional dependencies, or say what needs it and
    how to install it: ``optional_import("onnx", "stepnet.onnx", "pip install
    'stepnet[onnx]'")``."""
    import sys

    try:
        __import__(module)  # the import statement's hook, as `import torch` would
    except ImportError as exc:
        raise UnsupportedError(f"{what} needs {module}: {install}") from exc
    return sys.modules[module]
