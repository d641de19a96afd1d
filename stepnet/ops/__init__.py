"""stepnet's ops: the primitives (one :mod:`stepnet.registry` entry each,
registered by the modules ``primitives.py`` imports) and the composites built
from them. Use them as ``sn.ops.tanh(x)`` and so on."""

from .. import registry
from . import composites, primitives  # noqa: F401 - primitives fills the registry

# sn.ops.<name>: every primitive's function (from its entry) and every composite
globals().update({name: op.function for name, op in registry.all_ops().items()})
globals().update({name: getattr(composites, name) for name in composites.__all__})

__all__ = sorted([*registry.all_ops(), *composites.__all__, "registry"])
